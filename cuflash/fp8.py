"""FP8 (e4m3) inputs for attention: quantization with the scales an FP8 kernel takes, the
incoherent-processing rotation, and the arithmetic of an FP8 attention kernel emulated on the CPU.

- :func:`quantize` turns a 16- or 32-bit q, k or v into ``float8_e4m3fn`` values and float32
  descale factors, per tensor or per (batch, head) as FlashAttention-3 takes them
  (``x ~= dequantize(x8, descale)``); values saturate at ±448 (e4m3's largest finite value) where
  a plain cast would give NaN.
- :func:`hadamard_rotation` is a random orthogonal matrix R (a Walsh-Hadamard matrix with random
  signs, block-diagonal when d is not a power of two): q R and k R have the same scores,
  ``(q R)(k R)^T = q k^T``, but an outlier channel is spread over all channels, so the per-tensor
  amax falls and e4m3's 3 mantissa bits cover more of the values ("incoherent processing").
- :func:`emulate_attention` is what an FP8 forward kernel computes, step by step: e4m3 products
  accumulated in float32, the scores scaled by ``scale * q_descale * k_descale``, the online
  softmax in float32, P rounded to e4m3 for P V (or to ``p_dtype``; against the row max, or the
  running maxima of an online softmax's key tiles), the float32 accumulator scaled by
  ``v_descale / l``, the output rounded once. It is the yardstick of the accuracy table in
  docs/fp8.md and of the GPU kernel's tests; it materializes the scores (small problems only).

NumPy arrays (ml_dtypes' ``float8_e4m3fn``). ``cuflash.attention`` takes such arrays with their
descale factors on the NumPy backend, and GPU e4m3 inputs on the Hopper e4m3 kernel, whose
arithmetic this emulates with ``block_n`` = its key tile (core.fp8_inputs, docs/fp8.md).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .core import masks
from .core.fp8_inputs import E4M3
from .core.arrays import BFLOAT16, FLOAT32

__all__ = ["E4M3", "E4M3_MAX", "to_e4m3", "quantize", "dequantize", "hadamard_rotation", "emulate_attention"]

E4M3_MAX = float(ml_dtypes.finfo(E4M3).max)  # 448
GRANULARITIES = ("tensor", "head")
_WIDE = (np.dtype(np.float16), np.dtype(BFLOAT16), np.dtype(np.float32))


def _check_numpy(name, x):
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a NumPy array, got {type(x).__module__}.{type(x).__name__}")
    return x


def to_e4m3(x) -> np.ndarray:
    """Round float values to e4m3 (nearest, ties to even), saturating at ±E4M3_MAX; NaN stays NaN."""
    x = np.asarray(x, dtype=np.float32)
    return np.clip(x, -E4M3_MAX, E4M3_MAX).astype(E4M3)


def quantize(x, *, granularity: str = "tensor", layout: str = "bhsd"):
    """(x8, descale): x in e4m3 and the float32 factor(s) that map it back, ``x ~= x8 * descale``.

    x : a NumPy float16, bfloat16 or float32 array: (..., H, N, d) for ``layout="bhsd"``, (..., N,
        H, d) for ``"bshd"``, or (N, d).
    granularity : ``"tensor"`` (one descale, shape ()) or ``"head"`` (one per batch entry and head,
        shape x's batch axes + (H,), FlashAttention-3's per-(batch, K/V head) descale).

    descale = amax / 448 over each group (1 for a group of zeros), so each group's largest value
    maps to e4m3's largest finite value; the quantization error of a value is then at most
    2^-4 of its magnitude (3 mantissa bits, round to nearest) down to the subnormal range.
    """
    _check_numpy("x", x)
    if np.dtype(x.dtype) not in _WIDE:
        raise TypeError(f"x: expected float16, bfloat16 or float32, got {np.dtype(x.dtype).name}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout: expected 'bhsd' or 'bshd', got {layout!r}")
    if x.ndim < 2:
        raise ValueError(f"x: expected at least 2 dimensions (N, d), got shape {x.shape}")
    if not np.isfinite(x.astype(np.float32)).all():
        raise ValueError("x: has NaN or infinite values, which have no e4m3 scale")
    xf = x.astype(np.float32)
    if granularity == "tensor" or x.ndim == 2:
        amax = np.float32(np.abs(xf).max(initial=0.0))
        descale = np.float32(amax / E4M3_MAX) if amax > 0 else np.float32(1.0)
        return to_e4m3(xf / descale), np.asarray(descale, dtype=FLOAT32)
    axes = (-2, -1) if layout == "bhsd" else (-3, -1)
    amax = np.abs(xf).max(axis=axes, initial=0.0)  # batch axes + (H,)
    descale = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(FLOAT32)
    expand = descale[..., None, None] if layout == "bhsd" else descale[..., None, :, None]
    return to_e4m3(xf / expand), descale


def dequantize(x8, descale, *, layout: str = "bhsd") -> np.ndarray:
    """x8 * descale in float32 (descale of shape () or x8's batch axes + (H,), as :func:`quantize`)."""
    _check_numpy("x8", x8)
    if np.dtype(x8.dtype) != E4M3:
        raise TypeError(f"x8: expected float8_e4m3fn, got {np.dtype(x8.dtype).name}")
    d = np.asarray(descale, dtype=np.float32)
    if d.ndim == 0:
        return x8.astype(np.float32) * d
    want = _head_shape(x8.shape, layout)
    if d.shape != want:
        raise ValueError(f"descale: expected shape () or {want} for x8 {x8.shape} ({layout}), got {d.shape}")
    return x8.astype(np.float32) * (d[..., None, None] if layout == "bhsd" else d[..., None, :, None])


def _head_shape(shape, layout):
    if len(shape) < 3:
        return ()
    return tuple(shape[:-2]) if layout == "bhsd" else tuple(shape[:-3]) + (shape[-2],)


def hadamard_rotation(d: int, *, seed: int = 0) -> np.ndarray:
    """A random orthogonal (d, d) float32 matrix H diag(s) / sqrt(n): Walsh-Hadamard blocks of
    n = the largest power of two dividing d (block-diagonal when d is not a power of two), times
    random signs s. Apply the same matrix to q and k (``q @ R``, ``k @ R``): the scores do not
    change, while a large channel is spread over n channels."""
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
        raise ValueError(f"d: expected a positive int, got {d!r}")
    n = d & -d  # the largest power of two dividing d
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    block = h / np.sqrt(n)
    rot = np.kron(np.eye(d // n), block)
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=d)
    return (signs[:, None] * rot).astype(np.float32)  # diag(s) H: orthogonal, rows scaled by +-1


def _bhsd(x, layout):
    return x if layout == "bhsd" else np.swapaxes(x, -2, -3)


def _round_to(x, dtype):
    return x.astype(dtype).astype(np.float64)


def emulate_attention(q8, k8, v8, q_descale, k_descale, v_descale, *, causal=False, scale=None, layout="bhsd",
                      out_dtype=BFLOAT16, p_dtype=E4M3, block_n=None, window=None, mask=None):
    """(o, lse) of an FP8 forward kernel's arithmetic on e4m3 q8, k8, v8 (4-D, GQA allowed) and
    their descales (shape () or (B, H) of that tensor's heads, as :func:`quantize` gives). 16-bit
    inputs with descales 1 and ``p_dtype`` = their dtype give the 16-bit kernels' arithmetic.

    Steps (float32 where the kernel keeps float32; sums of exact e4m3 products taken in float64
    and rounded once to float32, i.e. the kernel's float32 accumulation up to its summation order):
    S = fl32(q8 k8^T) * fl32(scale * q_descale * k_descale); m = rowmax S; P = fl32(exp(S - m));
    l = fl32(sum P); P8 = P rounded to ``p_dtype`` (e4m3: the P V operands; bfloat16 for a
    16-bit P V); o = fl(fl32(P8 v8) * v_descale / l) in ``out_dtype``; lse = m + log l.
    ``causal``: False, True / "bottom_right" or "top_left", ``window``: (left, right) (cuflash.attention's
    meanings); ``mask``: a boolean (Nq, Nk) visibility in their place (e.g. one packed sequence's
    keys after others that a kernel's first key tile also reads).

    ``block_n``: P rounded where an online softmax over key tiles of ``block_n`` keys rounds it
    (the GPU kernel's tile): tile t's P = fl32(exp(S - m_t)) against the running max m_t of the
    tiles so far, l and the float32 accumulator of P8 v8 rescaled by exp(m_{t-1} - m_t) from tile
    to tile.
    """
    for name, x in (("q8", q8), ("k8", k8), ("v8", v8)):
        _check_numpy(name, x)
        if np.dtype(x.dtype) not in (E4M3,) + _WIDE:
            raise TypeError(f"{name}: expected float8_e4m3fn (or a 16/32-bit float with descale 1), "
                            f"got {np.dtype(x.dtype).name}")
        if x.ndim != 4:
            raise ValueError(f"{name}: expected 4 dimensions, got shape {x.shape}")
    q, k, v = (_bhsd(x, layout).astype(np.float64) for x in (q8, k8, v8))
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or hq % hkv:
        raise ValueError(f"k8, v8: shapes {k8.shape}, {v8.shape} do not match q8 {q8.shape} ({layout})")
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)

    def per_head(name, descale, heads):
        a = np.asarray(descale, dtype=np.float32)
        if a.ndim == 0:
            return np.broadcast_to(a, (b, heads)).astype(np.float64)
        if a.shape != (b, heads):
            raise ValueError(f"{name}: expected shape () or {(b, heads)}, got {a.shape}")
        return a.astype(np.float64)

    dq = per_head("q_descale", q_descale, hq)
    dk = np.repeat(per_head("k_descale", k_descale, hkv), hq // hkv, axis=1)
    dv = np.repeat(per_head("v_descale", v_descale, hkv), hq // hkv, axis=1)
    k, v = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)
    s = _round_to(q @ np.swapaxes(k, -1, -2), np.float32)
    s = _round_to(s * _round_to(scale * dq * dk, np.float32)[..., None, None], np.float32)
    if mask is None:
        vis = masks.mask_matrix(np, masks.normalize_causal(causal), nq, nk, masks.normalize_window(window))
    else:
        vis = np.asarray(mask, dtype=bool)
        if vis.shape != (nq, nk) or causal not in (False, None) or window is not None:
            raise ValueError(f"mask: expected a ({nq}, {nk}) boolean array without causal= or window=, got shape "
                             f"{vis.shape}")
    s = np.where(vis, s, -np.inf)
    if block_n is None:
        m = s.max(axis=-1, keepdims=True)
        m0 = np.where(np.isfinite(m), m, 0.0)
        p = _round_to(np.exp(s - m0), np.float32)
        ell = _round_to(p.sum(axis=-1, keepdims=True), np.float32)
        acc = _round_to(_round_to(p, p_dtype) @ v, np.float32)
    else:
        if isinstance(block_n, bool) or not isinstance(block_n, (int, np.integer)) or block_n < 1:
            raise ValueError(f"block_n: expected a positive int or None, got {block_n!r}")
        m, ell, acc = _online_softmax(s, v, int(block_n), p_dtype)
    seen = np.isfinite(m)
    m0 = np.where(seen, m, 0.0)
    o = np.where(seen, acc * dv[..., None, None] / np.where(seen, ell, 1.0), 0.0)
    lse = np.where(seen, m0 + np.log(np.where(seen, ell, 1.0)), -np.inf)[..., 0].astype(np.float32)
    o = o.astype(out_dtype)
    return _bhsd(o, layout), lse


def _online_softmax(s, v, block_n, p_dtype):
    """(running max m, l, float32 accumulator of P8 v) of the online softmax over key tiles of
    block_n keys (emulate_attention's ``block_n``), float64 arrays holding float32 values."""
    shape = s.shape[:-1] + (1,)
    m = np.full(shape, -np.inf)
    ell = np.zeros(shape)
    acc = np.zeros(s.shape[:-1] + (v.shape[-1],))
    for t0 in range(0, s.shape[-1], block_n):
        st = s[..., t0:t0 + block_n]
        mx = np.maximum(m, st.max(axis=-1, keepdims=True))
        base = np.where(np.isfinite(mx), mx, 0.0)
        alpha = _round_to(np.exp(m - base), np.float32)  # exp(-inf) = 0 on a row's first keys
        p = _round_to(np.exp(st - base), np.float32)
        ell = _round_to(ell * alpha + _round_to(p.sum(axis=-1, keepdims=True), np.float32), np.float32)
        acc = _round_to(acc * alpha + _round_to(_round_to(p, p_dtype) @ v[..., t0:t0 + block_n, :], np.float32),
                        np.float32)
        m = mx
    return m, ell, acc
