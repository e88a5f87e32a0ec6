"""The accounting functions' arguments, checked: integers, shapes, choices, dtypes, head counts,
and the problem dimensions of q, k, v (arrays or shapes). Each error names its argument."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from ..core.arrays import BFLOAT16, SUPPORTED_DTYPES, dtype_name
from ..core.fp8_inputs import E4M3
from ..plan import schedule


PASSES = ("fwd", "bwd", "fwd+bwd")
METHODS = ("tiled", "reference")
LAYOUTS = ("bhsd", "bshd")


def check_int(name, x, minimum=0):
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name}: expected an integer, got {type(x).__name__}")
    x = int(x)
    if x < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {x}")
    return x


def check_shape(name, s):
    if isinstance(s, (str, bytes)) or not hasattr(s, "__iter__"):
        raise TypeError(f"{name}: expected a shape (a tuple of integers), got {type(s).__name__}")
    return tuple(check_int(f"{name}[{i}]", x) for i, x in enumerate(s))


def check_choice(name, x, choices):
    if x not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {x!r}")
    return x


def check_dtype(name, dtype, e4m3=False):
    """A float16 / bfloat16 / float32 dtype (``e4m3``: float8_e4m3fn too), else TypeError naming it."""
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        return BFLOAT16
    if isinstance(dtype, str) and dtype.lower() in ("float8_e4m3fn", "e4m3"):
        dtype = E4M3
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{name}: not a dtype: {dtype!r}") from e
    if e4m3 and dt == E4M3:
        return dt
    if dt not in SUPPORTED_DTYPES:
        also = ("" if e4m3 else "; float8_e4m3fn is modelled by memory_report and io_model (the e4m3 forward)"
                if dt == E4M3 else "")
        wants = "float16, bfloat16, float32 or float8_e4m3fn" if e4m3 else "float16, bfloat16 or float32"
        raise TypeError(f"{name}: dtype {dtype_name(dt)} is not supported; expected {wants}{also}")
    return dt


def int_list(name, x):
    """A sequence of ints (list, tuple, NumPy or CuPy array) as a list of Python ints."""
    if hasattr(x, "tolist") and not isinstance(x, (list, tuple)):
        if getattr(x, "ndim", 1) != 1:
            raise ValueError(f"{name}: expected a 1-D sequence of integers, got shape {x.shape}")
        if not np.issubdtype(np.dtype(x.dtype), np.integer):
            raise TypeError(f"{name}: expected integers, got dtype {x.dtype}")
        x = x.tolist()
    if isinstance(x, (str, bytes)) or not hasattr(x, "__iter__"):
        raise TypeError(f"{name}: expected a sequence of integers, got {type(x).__name__}")
    return [check_int(f"{name}[{i}]", v) for i, v in enumerate(x)]


def split_heads(name, shape, layout):
    """(batch, heads, seq, d) of one (..., H, N, d) / (..., N, H, d) / (N, d) shape."""
    if len(shape) < 2:
        raise ValueError(f"{name}: expected at least 2 dimensions (N, d) or (..., H, N, d), got {shape}")
    if len(shape) == 2:
        return (), 1, shape[0], shape[1]
    if layout == "bhsd":
        return shape[:-3], shape[-3], shape[-2], shape[-1]
    return shape[:-3], shape[-2], shape[-3], shape[-1]


def check_heads(hq, hkv, name="k"):
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{name}: number of heads {hkv} must divide q's number of heads {hq} (MQA/GQA)")


def as_shape_and_dtype(name, x):
    """An array gives (shape, dtype); a shape gives (shape, None)."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return tuple(int(s) for s in x.shape), np.dtype(x.dtype)
    return check_shape(name, x), None


def input_dtype(named, dtype, bits=False):
    """The inputs' one dtype: ``dtype`` (the arrays' must equal it), else the arrays', else bfloat16.
    A uint8 array holds float8_e4m3fn bits (as CuPy holds e4m3, core.fp8_inputs) where ``dtype``
    is float8_e4m3fn or ``bits`` (a descale was given: cuflash.attention's rule)."""
    want = None if dtype is None else check_dtype("dtype", dtype, e4m3=True)
    dtypes = {}
    for name, x in named:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            adt = np.dtype(x.dtype)
            if adt == np.uint8 and (want == E4M3 or bits):
                adt = E4M3
            dtypes[name] = check_dtype(name, adt, e4m3=True)
    if want is not None:
        for name, adt in dtypes.items():
            if adt != want:
                raise TypeError(f"{name}: dtype {dtype_name(adt)} differs from dtype={dtype_name(want)}")
        return want
    if dtypes:
        want = next(iter(dtypes.values()))
        for name, adt in dtypes.items():
            if adt != want:
                raise TypeError(f"{name}: dtype {dtype_name(adt)} differs from the other inputs' {dtype_name(want)}")
        return want
    return BFLOAT16  # shapes only and no dtype: the common training dtype (stated in the report)


def problem_dims(q, k, v, layout, dtype, bits=False):
    check_choice("layout", layout, LAYOUTS)
    named = [("q", q), ("k", k), ("v", k if v is None else v)]
    shapes = {name: as_shape_and_dtype(name, x)[0] for name, x in named}
    dt = input_dtype(named, dtype, bits)
    qb, hq, nq, d = split_heads("q", shapes["q"], layout)
    kb, hkv, nk, dk = split_heads("k", shapes["k"], layout)
    vb, hv, nv, dv = split_heads("v", shapes["v"], layout)
    if not (len(shapes["q"]) == len(shapes["k"]) == len(shapes["v"])) or kb != qb or vb != qb:
        raise ValueError(f"k, v: batch dimensions {kb}, {vb} must equal q's {qb}")
    if dk != d:
        raise ValueError(f"k: head dim {dk} must equal q's head dim {d}")
    if dv == 0:
        raise ValueError("v: head dim must be at least 1")
    if (hv, nv) != (hkv, nk):
        raise ValueError(f"v: heads and length ({hv}, {nv}) must equal k's ({hkv}, {nk})")
    if d == 0:
        raise ValueError("q: head dim d must be at least 1")
    check_heads(hq, hkv)
    return SimpleNamespace(batch=math.prod(qb), hq=hq, hkv=hkv, nq=nq, nk=nk, d=d, dv=dv, dtype=dt)


def check_head_dim(d, shape_name):
    if d > schedule.MAX_HEAD_DIM:
        raise ValueError(f"{shape_name}: head dim {d} is larger than the tiled kernels' largest, {schedule.MAX_HEAD_DIM}")


def check_config(config, name="config"):
    for attr in ("block_m", "block_n"):
        if not isinstance(getattr(config, attr, None), int) or getattr(config, attr) < 1:
            raise TypeError(f"{name}: expected a cuflash.plan.schedule.TileConfig (positive block_m, block_n), got {config!r}")
    return config
