"""FP8 (e4m3) inputs of cuflash.attention: which calls have them, their descale factors checked,
and the float32 values they stand for.

q, k and v in ``float8_e4m3fn`` (ml_dtypes), or k and v alone with a 16-bit q (an FP8 KV cache),
stand for ``x8 * descale`` (on the GPU, CuPy uint8 arrays of e4m3 bits count as e4m3 in a call
that passes descale factors): a descale is a float32
array of shape () or (1,) (per tensor), or the tensor's batch axes + (H,) (per batch entry and
head; q also takes FlashAttention-3's batch axes + (Hkv,), one factor per K/V head's group of
query heads). Packed inputs (cu_seqlens_*) and a paged cache take one factor per tensor. Without
a descale the factor is 1.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .arrays import BFLOAT16, FLOAT16, FLOAT32, array_namespace, dtype_name, is_cupy_array

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
OUT_DTYPES = (BFLOAT16, FLOAT16, FLOAT32)  # an FP8 forward's output (default bfloat16, as FlashAttention-3's)
NAMES = ("q", "k", "v")


def requested(arrays, descales) -> bool:
    """Whether a call has FP8 inputs (NumPy or CuPy arrays: the ones that run them; other arrays are
    not read before their own validation) or descale factors."""
    return (any((isinstance(a, np.ndarray) or is_cupy_array(a)) and a.dtype == E4M3 for a in arrays)
            or any(x is not None for x in descales))


def holds_e4m3(a) -> bool:
    """An array of e4m3 values: dtype float8_e4m3fn, or a CuPy array of their bits (uint8; CuPy may
    have no float8 dtype) in a call that passes descale factors (requested: only those reach here)."""
    dtype = getattr(a, "dtype", None)
    return dtype == E4M3 or (is_cupy_array(a) and dtype == np.uint8)


def kv_cache_only(arrays) -> bool:
    """q in float16/bfloat16 with an e4m3 k or v: an FP8 KV cache (FlashInfer's most used FP8
    form; check_call then wants both k and v in e4m3)."""
    q, k, v = arrays
    return getattr(q, "dtype", None) in (FLOAT16, BFLOAT16) and (holds_e4m3(k) or holds_e4m3(v))


def check_call(arrays, descales, out_dtype):
    """The output dtype of an FP8 call, after checking that q, k, v are e4m3 NumPy arrays, or q
    16-bit with an e4m3 k and v (then o has q's dtype by default and q takes no descale);
    TypeError / NotImplementedError naming the argument."""
    kv_cache = kv_cache_only(arrays)
    if kv_cache and descales[0] is not None:
        raise TypeError(f"q_descale: a {dtype_name(arrays[0].dtype)} q takes no descale (k and v are the FP8 cache)")
    for name, a in zip(NAMES, arrays):
        if name == "q" and kv_cache:
            continue
        if not holds_e4m3(a):
            given = [n for n, x in zip(NAMES, arrays) if holds_e4m3(x)]
            why = f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} float8_e4m3fn" if given else \
                "a descale factor was given"
            got = dtype_name(a.dtype) if hasattr(a, "dtype") else type(a).__name__
            raise TypeError(f"{name}: expected float8_e4m3fn ({why}), got {got}")
    for name, a in zip(NAMES, arrays):
        xp = array_namespace(a)
        if xp is not np and not (kv_cache and is_cupy_array(a)):
            raise NotImplementedError(f"{name}: float8_e4m3fn q, k and v run on the NumPy backend only (on the "
                                      "GPU: an e4m3 k and v with a 16-bit CuPy q, the FP8 KV cache of decoding)")
    xps = {array_namespace(a) for a in arrays}
    if len(xps) > 1:
        raise TypeError("q, k, v: expected arrays of one library (NumPy or CuPy), got a mix")
    if out_dtype is None:
        return np.dtype(arrays[0].dtype) if kv_cache else BFLOAT16
    try:
        odt = np.dtype(out_dtype)
    except TypeError:
        odt = None
    if odt not in OUT_DTYPES:
        raise ValueError(f"out_dtype: with float8_e4m3fn inputs expected bfloat16, float16 or float32, got {out_dtype!r}")
    return odt


def check_descale(name, descale, per_head_shapes, xp=np, validate=True):
    """descale as a float32 array: None -> 1; shape () / (1,) or one of ``per_head_shapes``
    (empty: per tensor only). With CuPy inputs (``xp``) a NumPy or CuPy descale; a CuPy one's
    values are checked on the host only with ``validate`` (a device-to-host copy)."""
    if descale is None:
        return np.ones((), dtype=FLOAT32)
    ns = array_namespace(descale)
    if ns is not np and (xp is np or ns is not xp):
        want = "a float32 NumPy array" if xp is np else "a float32 NumPy or CuPy array"
        raise TypeError(f"{name}: expected {want}, got {type(descale).__module__}.{type(descale).__name__}")
    if descale.dtype != FLOAT32:
        raise TypeError(f"{name}: expected dtype float32, got {dtype_name(descale.dtype)}")
    shape = tuple(descale.shape)
    if shape not in ((), (1,)) + tuple(per_head_shapes):
        wants = " or ".join(str(s) for s in ((), *per_head_shapes))
        raise ValueError(f"{name}: expected shape {wants}, got {shape}")
    if ns is np or validate:
        values = descale if ns is np else descale.get()
        if not np.isfinite(values).all():
            raise ValueError(f"{name}: has NaN or infinite values")
    return descale.reshape(()) if shape == (1,) else descale


def checked_descales(arrays, descales, layout, dense, validate=True):
    """The three descales checked (check_descale), None for a 16-bit q: per tensor, or (``dense``:
    no packed sequences or paged cache) per batch entry and head, q also per K/V head."""
    # (q per K/V head only where the heads divide: else the attention's validation names the heads)
    hkv = kv_heads_of(arrays[1], layout) if dense and group_of(arrays[0], arrays[1], layout) > 1 else None
    xp = array_namespace(arrays[1])
    out = []
    for name, a, descale in zip(NAMES, arrays, descales):
        if not holds_e4m3(a):  # (an FP8 KV cache's q: check_call refused a q_descale)
            out.append(None)
            continue
        shapes = per_head_shapes(a, layout, hkv if name == "q" else None) if dense else ()
        out.append(check_descale(f"{name}_descale", descale, shapes, xp, validate))
    return out


def _heads_axis(ndim, layout):
    """The head axis of a dense input of ndim dimensions, or None for a single head (N, d)."""
    if ndim == 2:
        return None
    return -2 if layout == "bshd" else -3


def dequantize(x8, descale, *, layout, group=1):
    """x8 * descale in float32. A per-head descale is (batch..., H); ``group`` > 1 (q only): it
    may have one factor per K/V head, shared by ``group`` query heads."""
    x = x8.astype(FLOAT32)
    if descale.ndim == 0:
        return x * descale
    axis = _heads_axis(x8.ndim, layout)
    if group > 1 and descale.shape[-1] * group == x8.shape[axis]:
        descale = np.repeat(descale, group, axis=-1)
    if axis is None:  # (N, d): a (1, 1) descale
        return x * descale.reshape(())
    return x * (descale[..., None, None] if axis == -3 else descale[..., None, :, None])


def per_head_shapes(a, layout, kv_heads=None):
    """The per-head descale shapes a dense input takes: its batch axes + (H,) (q: also + (Hkv,));
    (1, 1) for a single head (N, d)."""
    if a.ndim == 2:
        return ((1, 1),)
    axis = _heads_axis(a.ndim, layout)
    shapes = [a.shape[:-3] + (a.shape[axis],)]
    if kv_heads:
        shapes.append(a.shape[:-3] + (kv_heads,))
    return tuple(dict.fromkeys(shapes))


def kv_heads_of(k, layout):
    """K's head count from its shape (None for a single head)."""
    axis = _heads_axis(k.ndim, layout)
    return None if axis is None else k.shape[axis]


def group_of(q, k, layout):
    """Query heads per K/V head from the dense shapes (1 where they do not divide: the attention's
    own validation names that error)."""
    if q.ndim == 2 or k.ndim != q.ndim:
        return 1
    axis = _heads_axis(q.ndim, layout)
    hq, hkv = q.shape[axis], k.shape[axis]
    return hq // hkv if hkv and hq % hkv == 0 else 1
