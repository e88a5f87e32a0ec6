"""FP8 (e4m3) inputs of cuflash.attention: which calls have them, their descale factors checked,
and the float32 values they stand for.

q, k and v in ``float8_e4m3fn`` (ml_dtypes), or k and v alone with a 16-bit q (an FP8 KV cache),
stand for ``x8 * descale``: a descale is a float32
array of shape () or (1,) (per tensor), or the tensor's batch axes + (H,) (per batch entry and
head; q also takes FlashAttention-3's batch axes + (Hkv,), one factor per K/V head's group of
query heads). Packed inputs (cu_seqlens_*) and a paged cache take one factor per tensor. Without
a descale the factor is 1.

GPU inputs (the e4m3 forward kernel, sm_90): CuPy has no float8 dtype, so CuPy arrays hold e4m3
values as their bits, dtype uint8 (or float8_e4m3fn, should CuPy store it); a call with GPU
arrays is an FP8 call when it passes a descale factor (1 for unscaled values: a uint8 array alone
is not taken for e4m3) or has torch ``float8_e4m3fn`` tensors. The descales are then float32
arrays of the inputs' library and device, their values not read on the host. The GPU takes
causal masks, sliding windows, packed sequences (per-tensor descales) and kv_lens; the other
options raise NotImplementedError naming themselves (:data:`GPU_OPTIONS`).
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

from .arrays import BFLOAT16, FLOAT16, FLOAT32, array_namespace, dtype_name, is_cupy_array

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
OUT_DTYPES = (BFLOAT16, FLOAT16, FLOAT32)  # an FP8 forward's output (default bfloat16, as FlashAttention-3's)
NAMES = ("q", "k", "v")


def requested(arrays, descales) -> bool:
    """Whether a call has FP8 inputs (NumPy e4m3 arrays, torch float8_e4m3fn tensors; other arrays
    are not read before their own validation) or descale factors."""
    return (any((isinstance(a, np.ndarray) and a.dtype == E4M3) or is_torch_e4m3(a) for a in arrays)
            or any(x is not None for x in descales))


def is_torch_e4m3(a) -> bool:
    """A torch float8_e4m3fn tensor (torch is never imported here: such a tensor can only exist once
    it is)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(a, torch.Tensor) and a.dtype == getattr(torch, "float8_e4m3fn", None)


def as_bits(a):
    """A torch float8_e4m3fn tensor as a uint8 view of its bits (the arrays the GPU path takes:
    cuflash.api.interop maps torch uint8 onto CuPy uint8); anything else unchanged."""
    if is_torch_e4m3(a):
        import torch

        return a.view(torch.uint8)
    return a


def on_gpu(arrays) -> bool:
    """Whether an FP8 call runs the GPU path: any of q, k, v is not a NumPy array (mixed kinds then
    fail that path's checks, naming the odd one)."""
    return any(not isinstance(a, np.ndarray) for a in arrays)


# The options the e4m3 GPU kernels do not take (the NumPy backend takes them all).
GPU_OPTIONS = ("block_table", "softcap", "alibi_slopes", "sinks")
_GPU_BITS = (np.dtype(np.uint8), E4M3)


def refuse_gpu_options(options):
    """NotImplementedError naming the first option of GPU_OPTIONS that is set."""
    for name in GPU_OPTIONS:
        if options.get(name) is not None:
            raise NotImplementedError(
                f"{name}: not implemented for float8_e4m3fn GPU inputs (the e4m3 kernels take causal masks, "
                "windows, packed sequences and kv_lens; no paged cache or score modifiers); NumPy inputs run it "
                "on the NumPy backend")


def check_gpu_call(arrays, out_dtype):
    """The output dtype of an FP8 GPU call (bfloat16 by default, or float16), after checking that
    q, k, v hold e4m3 bits (uint8, or float8_e4m3fn); TypeError / NotImplementedError /
    ValueError naming the argument."""
    dtypes = [np.dtype(a.dtype) if hasattr(a, "dtype") else None for a in arrays]
    for name, a, dt in zip(NAMES, arrays, dtypes):
        if dt not in _GPU_BITS:
            got = dtype_name(dt) if dt is not None else type(a).__name__
            raise TypeError(f"{name}: expected the e4m3 bits of a float8_e4m3fn GPU input (uint8, or "
                            f"float8_e4m3fn), got {got}")
    if out_dtype is None:
        return BFLOAT16
    try:
        odt = np.dtype(out_dtype)
    except TypeError:
        odt = None
    if odt == FLOAT32:
        raise NotImplementedError("out_dtype: float32 is not implemented for float8_e4m3fn GPU inputs (the kernel "
                                  "stores bfloat16 or float16)")
    if odt not in (BFLOAT16, FLOAT16):
        raise ValueError(f"out_dtype: with float8_e4m3fn GPU inputs expected bfloat16 or float16, got {out_dtype!r}")
    return odt


def checked_gpu_descales(arrays, descales, layout, xp, dense=True):
    """The three descales of a GPU call, each None (1) or a float32 array of ``xp`` (on q's device:
    cuflash.api.interop checks that) of shape () / (1,) or (``dense``; packed sequences take one
    factor per tensor, as on the NumPy backend) a per-head shape (per_head_shapes; q also per K/V
    head where the heads divide); values not read. TypeError / ValueError naming the argument."""
    hkv = kv_heads_of(arrays[1], layout) if dense and group_of(arrays[0], arrays[1], layout) > 1 else None
    out = []
    for name, a, descale in zip(NAMES, arrays, descales):
        name = f"{name}_descale"
        if descale is None:
            out.append(None)
            continue
        if array_namespace(descale) is not xp:
            raise TypeError(f"{name}: expected a {xp.__name__}.ndarray like the inputs, got "
                            f"{type(descale).__module__}.{type(descale).__name__}")
        if descale.dtype != FLOAT32:
            raise TypeError(f"{name}: expected dtype float32, got {dtype_name(descale.dtype)}")
        shapes = per_head_shapes(a, layout, hkv if name == "q_descale" else None) if dense else ()
        shape = tuple(descale.shape)
        if shape not in ((), (1,)) + tuple(shapes):
            wants = " or ".join(str(s) for s in ((), *shapes))
            why = "" if dense else " (packed sequences take one factor per tensor)"
            raise ValueError(f"{name}: expected shape {wants}{why}, got {shape}")
        out.append(descale)
    return out


def batch_entry_descales(descales, b):
    """Checked GPU descales (checked_gpu_descales) of batch entry b alone: a per-head factor's row b
    as a (1, H) view, a per-tensor one (or None) as it is (kv_lens runs each entry on its own)."""
    return [d if d is None or d.ndim == 0 or d.shape == (1,) else d.reshape(-1, d.shape[-1])[b:b + 1]
            for d in descales]


def holds_e4m3(a) -> bool:
    """An array of e4m3 values: dtype float8_e4m3fn, or a CuPy array of their bits (uint8) in an FP8
    call (requested: only those reach here)."""
    dtype = getattr(a, "dtype", None)
    return dtype == E4M3 or (is_cupy_array(a) and dtype == np.uint8)


def kv_cache_only(arrays) -> bool:
    """q in float16/bfloat16 with an e4m3 k or v: an FP8 KV cache (FlashInfer's most used FP8
    form; check_call then wants both k and v in e4m3)."""
    q, k, v = arrays
    return getattr(q, "dtype", None) in (FLOAT16, BFLOAT16) and (holds_e4m3(k) or holds_e4m3(v))


def check_call(arrays, descales, out_dtype):
    """The output dtype of an FP8 call on the NumPy backend, after checking that q, k, v are e4m3
    NumPy arrays, or q 16-bit with an e4m3 k and v (then o has q's dtype by default and q takes no
    descale); TypeError / ValueError naming the argument."""
    kv_cache = kv_cache_only(arrays)
    if kv_cache and descales[0] is not None:
        raise TypeError(f"q_descale: a {dtype_name(arrays[0].dtype)} q takes no descale (k and v are the FP8 cache)")
    for name, a in zip(NAMES, arrays):
        if name == "q" and kv_cache:
            continue
        if getattr(a, "dtype", None) != E4M3:
            given = [n for n, x in zip(NAMES, arrays) if getattr(x, "dtype", None) == E4M3]
            why = f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} float8_e4m3fn" if given else \
                "a descale factor was given"
            got = dtype_name(a.dtype) if hasattr(a, "dtype") else type(a).__name__
            raise TypeError(f"{name}: expected float8_e4m3fn ({why}), got {got}")
    if out_dtype is None:
        return np.dtype(arrays[0].dtype) if kv_cache else BFLOAT16
    try:
        odt = np.dtype(out_dtype)
    except TypeError:
        odt = None
    if odt not in OUT_DTYPES:
        raise ValueError(f"out_dtype: with float8_e4m3fn inputs expected bfloat16, float16 or float32, got {out_dtype!r}")
    return odt


def check_descale(name, descale, per_head_shapes):
    """descale as a float32 NumPy array: None -> 1; shape () / (1,) or one of ``per_head_shapes``
    (empty: per tensor only)."""
    if descale is None:
        return np.ones((), dtype=FLOAT32)
    if not isinstance(descale, np.ndarray):
        raise TypeError(f"{name}: expected a float32 NumPy array, got {type(descale).__module__}.{type(descale).__name__}")
    if descale.dtype != FLOAT32:
        raise TypeError(f"{name}: expected dtype float32, got {dtype_name(descale.dtype)}")
    shape = tuple(descale.shape)
    if shape not in ((), (1,)) + tuple(per_head_shapes):
        wants = " or ".join(str(s) for s in ((), *per_head_shapes))
        raise ValueError(f"{name}: expected shape {wants}, got {shape}")
    if not np.isfinite(descale).all():
        raise ValueError(f"{name}: has NaN or infinite values")
    return descale.reshape(()) if shape == (1,) else descale


def checked_descales(arrays, descales, layout, dense):
    """The three descales checked (check_descale), None for a 16-bit q: per tensor, or (``dense``:
    no packed sequences or paged cache) per batch entry and head, q also per K/V head."""
    # (q per K/V head only where the heads divide: else the attention's validation names the heads)
    hkv = kv_heads_of(arrays[1], layout) if dense and group_of(arrays[0], arrays[1], layout) > 1 else None
    out = []
    for name, a, descale in zip(NAMES, arrays, descales):
        if a.dtype != E4M3:  # (an FP8 KV cache's q: check_call refused a q_descale)
            out.append(None)
            continue
        shapes = per_head_shapes(a, layout, hkv if name == "q" else None) if dense else ()
        out.append(check_descale(f"{name}_descale", descale, shapes))
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
