"""Test helpers shared by the CPU and GPU tests: inputs, the naive-in-dtype yardstick, the rule.

The accuracy rule: compare a result with the float64 reference computed from the *same*
low-precision inputs, and allow at most ``factor`` times the error of the naive formula evaluated
in the input dtype (every primitive op exact, then rounded to the dtype), plus one rounding of
the largest reference value:

    max|got - ref| <= factor * max|naive - ref| + u * max|ref|

where u is the dtype's unit roundoff. The naive error is measured, not assumed, so the bound
tracks the inputs: it is a statement that the kernel is no worse than a careful evaluation of the
formula in the precision of its inputs.

``mask=`` (every function below that takes it): an explicit boolean (Nq, Nk) visibility matrix
that replaces the ``causal`` mask, so a test can hold a windowed result to an oracle whose mask it
built itself rather than to cuflash.core.masks.

Works for NumPy and CuPy arrays (CuPy arrays are copied to the host with ``.get()``); bfloat16
comes from ml_dtypes.
"""

from __future__ import annotations

import numpy as np

from .core import masks
from .backends import reference
from .core.arrays import UNIT_ROUNDOFF, dtype_name
from .core.layout import from_bhsd, to_bhsd
from .core.problem import validate_forward

_F64 = np.float64


def to_numpy(a):
    """A NumPy array of ``a`` (CuPy arrays are copied from the device)."""
    if type(a).__module__.split(".")[0] == "cupy":
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


class _Rounded:
    """Evaluate each op exactly (float64) and round the result to the input dtype."""

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)

    def __call__(self, x):
        return np.asarray(x, dtype=_F64).astype(self.dtype).astype(_F64)


def _naive_setup(q, k, v, causal, scale, layout):
    q, k, v = (to_numpy(a) for a in (q, k, v))
    p = validate_forward(q, k, v, causal=causal, scale=scale, layout=layout)
    q4 = to_bhsd(q, p, p.hq, p.nq).astype(_F64)
    heads = np.arange(p.hq) // max(p.group, 1)
    k4 = to_bhsd(k, p, p.hkv, p.nk).astype(_F64)[:, heads]
    v4 = to_bhsd(v, p, p.hkv, p.nk).astype(_F64)[:, heads]
    return p, q4, k4, v4


def _naive_probs(p, q4, k4, rnd, mask=None):
    """P in dtype arithmetic, with the row max m and row sum l (float64 holding dtype values)."""
    s = rnd(np.matmul(q4, k4.swapaxes(-1, -2)))
    s = rnd(s * rnd(p.scale))
    if mask is None and p.causal is not None:
        mask = masks.mask_matrix(np, p.causal, p.nq, p.nk)
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    if p.nk == 0:
        m = np.full(s.shape[:-1] + (1,), -np.inf)
    else:
        m = s.max(axis=-1, keepdims=True)
    shift = np.where(m == -np.inf, 0.0, m)
    e = rnd(np.exp(rnd(s - shift)))
    l = rnd(e.sum(axis=-1, keepdims=True))
    probs = rnd(e / np.where(l > 0, l, 1.0))
    return probs, m, l


def naive_attention_in_dtype(q, k, v, *, causal=False, scale=None, layout="bhsd", mask=None):
    """(o, lse) by the naive formula, each primitive op exact then rounded to q's dtype.

    Returns NumPy arrays of the input dtype, shaped like cuflash.attention's outputs."""
    p, q4, k4, v4 = _naive_setup(q, k, v, causal, scale, layout)
    rnd = _Rounded(p.dtype)
    probs, m, l = _naive_probs(p, q4, k4, rnd, mask)
    o4 = rnd(np.matmul(probs, v4))
    seen = l > 0
    lse = np.where(seen, rnd(np.where(seen, m, 0.0) + rnd(np.log(np.where(seen, l, 1.0)))), -np.inf)[..., 0]
    return from_bhsd(o4.astype(p.dtype), p, p.hq, p.nq), lse.astype(p.dtype).reshape(p.lse_shape())


def naive_attention_backward_in_dtype(do, q, k, v, *, causal=False, scale=None, layout="bhsd", mask=None):
    """(dq, dk, dv) by the naive formula, each primitive op exact then rounded to q's dtype.

    D = rowsum(dO * O) with O the naive forward in dtype; dk and dv are summed over the query
    heads of a group (one more rounded op)."""
    p, q4, k4, v4 = _naive_setup(q, k, v, causal, scale, layout)
    do4 = to_bhsd(to_numpy(do), p, p.hq, p.nq).astype(_F64)
    rnd = _Rounded(p.dtype)
    probs, _, _ = _naive_probs(p, q4, k4, rnd, mask)
    o4 = rnd(np.matmul(probs, v4))
    dv_h = rnd(np.matmul(probs.swapaxes(-1, -2), do4))
    dprobs = rnd(np.matmul(do4, v4.swapaxes(-1, -2)))
    row_dot = rnd(rnd(do4 * o4).sum(axis=-1, keepdims=True))
    ds = rnd(probs * rnd(dprobs - row_dot))
    sc = rnd(p.scale)
    dq4 = rnd(rnd(np.matmul(ds, k4)) * sc)
    dk_h = rnd(rnd(np.matmul(ds.swapaxes(-1, -2), q4)) * sc)
    grouped = (p.batch, p.hkv, p.group, p.nk, p.d)
    dk4 = rnd(dk_h.reshape(grouped).sum(axis=2))
    dv4 = rnd(dv_h.reshape(grouped).sum(axis=2))
    return (
        from_bhsd(dq4.astype(p.dtype), p, p.hq, p.nq),
        from_bhsd(dk4.astype(p.dtype), p, p.hkv, p.nk),
        from_bhsd(dv4.astype(p.dtype), p, p.hkv, p.nk),
    )


def _canonical64(p, q_side, k_side):
    """(B, H, N, d) float64 copies of q-side and k-side NumPy arrays of problem p."""
    return ([to_bhsd(a, p, p.hq, p.nq).astype(_F64) for a in q_side]
            + [to_bhsd(a, p, p.hkv, p.nk).astype(_F64) for a in k_side])


def reference64(q, k, v, *, causal=False, scale=None, layout="bhsd", mask=None):
    """(o, lse) of the float64 reference from the same (low-precision) inputs, as NumPy float64."""
    q, k, v = (to_numpy(a) for a in (q, k, v))
    if mask is not None:
        p = validate_forward(q, k, v, causal=causal, scale=scale, layout=layout)
        o4, lse3 = reference.forward_bhsd(p, *_canonical64(p, (q,), (k, v)), mask=mask)
        return from_bhsd(o4, p, p.hq, p.nq), lse3.reshape(p.lse_shape())
    o, lse = reference.attention(q, k, v, causal=causal, scale=scale, layout=layout, return_lse=True,
                                 precision="float64")
    return o, lse


def reference64_backward(do, q, k, v, *, causal=False, scale=None, layout="bhsd", mask=None):
    """(dq, dk, dv) of the float64 reference from the same inputs, as NumPy float64.

    The reference rebuilds P from q and k; o and lse are only needed for validation and come
    from the float32 reference."""
    do, q, k, v = (to_numpy(a) for a in (do, q, k, v))
    if mask is not None:
        p = validate_forward(q, k, v, causal=causal, scale=scale, layout=layout)
        grads = reference.backward_bhsd(p, *_canonical64(p, (do, q), (k, v)), mask=mask)
        return tuple(from_bhsd(g, p, h, n) for g, (h, n) in zip(grads, ((p.hq, p.nq), (p.hkv, p.nk), (p.hkv, p.nk))))
    o, lse = reference.attention(q, k, v, causal=causal, scale=scale, layout=layout, return_lse=True)
    return reference.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale, layout=layout,
                                        precision="float64")


def recorded_allocations(fn):
    """(fn(), the byte sizes of every allocation fn makes from CuPy's default memory pool, in
    order), recorded through CuPy's allocator hook; the device is synchronized before and after."""
    import cupy

    cupy.cuda.Device().synchronize()
    pool = cupy.get_default_memory_pool()
    sizes = []

    def recording_malloc(nbytes):
        sizes.append(nbytes)
        return pool.malloc(nbytes)

    cupy.cuda.set_allocator(recording_malloc)
    try:
        result = fn()
        cupy.cuda.Device().synchronize()
    finally:
        cupy.cuda.set_allocator(pool.malloc)
    return result, sizes


def max_abs(x):
    return float(np.max(np.abs(x))) if x.size else 0.0


def assert_within_naive_error(name, got, ref64, naive, dtype, factor=2.0):
    """Assert max|got - ref| <= factor * max|naive - ref| + u * max|ref| (u of ``dtype``).

    Also: shapes agree, got is finite wherever ref is finite and equals ref where ref is
    infinite (lse = -inf for rows that see no key). The naive result must itself be finite where
    ref is, otherwise the bound would be vacuous and the test could not fail."""
    got = to_numpy(got).astype(_F64)
    ref = to_numpy(ref64).astype(_F64)
    nv = to_numpy(naive).astype(_F64)
    dtype = np.dtype(dtype)
    assert got.shape == ref.shape, f"{name}: shape {got.shape} != reference shape {ref.shape}"
    assert nv.shape == ref.shape, f"{name}: naive shape {nv.shape} != reference shape {ref.shape}"
    assert not np.isnan(ref).any(), f"{name}: the float64 reference has NaN"
    finite = np.isfinite(ref)
    bad = finite & ~np.isfinite(got)
    assert not bad.any(), f"{name}: {int(bad.sum())} non-finite values where the reference is finite"
    wrong_inf = ~finite & (got != ref)
    assert not wrong_inf.any(), (
        f"{name}: {int(wrong_inf.sum())} values differ where the reference is infinite "
        f"(e.g. got {got[wrong_inf][:3]}, want {ref[wrong_inf][:3]})"
    )
    assert np.isfinite(nv[finite]).all(), (
        f"{name}: the naive {dtype_name(dtype)} formula overflowed where the reference is finite; "
        "the bound would be vacuous - choose other inputs"
    )
    err = max_abs(got[finite] - ref[finite])
    naive_err = max_abs(nv[finite] - ref[finite])
    u = UNIT_ROUNDOFF[dtype]
    bound = factor * naive_err + u * max_abs(ref[finite])
    assert err <= bound, (
        f"{name} ({dtype_name(dtype)}): max error {err:.3e} > bound {bound:.3e} "
        f"= {factor} x naive-in-dtype error {naive_err:.3e} + u x max|ref| ({u:.1e} x {max_abs(ref[finite]):.3e})"
    )
    return err, bound


def assert_forward_within_naive_error(o, lse, q, k, v, *, causal=False, scale=None, layout="bhsd", factor=2.0,
                                      mask=None):
    """The accuracy rule for a forward result (o, and lse unless None) against the float64 reference."""
    dtype = to_numpy(q).dtype
    ref_o, ref_lse = reference64(q, k, v, causal=causal, scale=scale, layout=layout, mask=mask)
    naive_o, naive_lse = naive_attention_in_dtype(q, k, v, causal=causal, scale=scale, layout=layout, mask=mask)
    assert to_numpy(o).dtype == dtype, f"o: dtype {dtype_name(to_numpy(o).dtype)}, want {dtype_name(dtype)}"
    assert_within_naive_error("o", o, ref_o, naive_o, dtype, factor)
    if lse is not None:
        assert to_numpy(lse).dtype == np.float32, f"lse: dtype {dtype_name(to_numpy(lse).dtype)}, want float32"
        assert_within_naive_error("lse", lse, ref_lse, naive_lse, dtype, factor)


def assert_backward_within_naive_error(grads, do, q, k, v, *, causal=False, scale=None, layout="bhsd", factor=3.0,
                                       mask=None):
    """The accuracy rule for (dq, dk, dv) against the float64 reference gradients."""
    dtype = to_numpy(q).dtype
    refs = reference64_backward(do, q, k, v, causal=causal, scale=scale, layout=layout, mask=mask)
    naives = naive_attention_backward_in_dtype(do, q, k, v, causal=causal, scale=scale, layout=layout, mask=mask)
    for name, got, ref, naive in zip(("dq", "dk", "dv"), grads, refs, naives):
        assert to_numpy(got).dtype == dtype, f"{name}: dtype {dtype_name(to_numpy(got).dtype)}, want {dtype_name(dtype)}"
        assert_within_naive_error(name, got, ref, naive, dtype, factor)
