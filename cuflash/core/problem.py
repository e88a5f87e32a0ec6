"""Argument validation: turn the public arguments into one checked description of the problem.

Every backend (NumPy, CUDA, reference) starts from :class:`Problem`, so the rules for shapes,
dtypes, layouts, masks and ``out=`` live in one place and every error names its argument.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from dataclasses import dataclass, field

import numpy as np

from . import masks
from .arrays import BFLOAT16, FLOAT16, FLOAT32, SUPPORTED_DTYPES, array_namespace, dtype_name, is_real_number, may_share_memory

LAYOUTS = ("bhsd", "bshd")


@dataclass(frozen=True)
class Problem:
    """A validated attention problem. Shapes are logical: batch, heads, sequence, head dim."""

    xp: object  # numpy or cupy
    layout: str
    batch_shape: tuple
    hq: int
    hkv: int
    nq: int
    nk: int
    d: int
    dtype: np.dtype
    causal: str | None  # None, "bottom_right" or "top_left"
    scale: float
    single_head: bool = False  # inputs were 2-D (N, d): outputs are too, and lse is (N,)
    window: tuple | None = None  # (left, right) sliding window (masks.row_bounds); None: no window
    # Score modifiers (check_score_mods). Arrays are the caller's library's, on q's device.
    softcap: float | None = None  # scores become softcap * tanh(s / softcap) before masking
    alibi: object = field(default=None, compare=False)  # (B, Hq) float32 slopes (B: batch or sequences)
    sinks: object = field(default=None, compare=False)  # (Hq,) float32 logits joining each row's softmax
    head_dim_v: int | None = None  # v's (and o's) head dim where it differs from q's and k's d

    @property
    def dv(self) -> int:
        """The head dim of v, o, do and dv (d unless v's differs)."""
        return self.d if self.head_dim_v is None else self.head_dim_v

    @property
    def modified(self) -> bool:
        """Whether any score modifier (softcap, ALiBi, sinks) is given."""
        return self.softcap is not None or self.alibi is not None or self.sinks is not None

    @property
    def scores_modified(self) -> bool:
        """Whether the scores themselves change (softcap, ALiBi); sinks change only the softmax's
        denominator, which the backward reads through lse."""
        return self.softcap is not None or self.alibi is not None

    def sequence(self, b, **changes):
        """The problem of batch entry (or packed sequence) b alone: ``changes`` replaced, and the
        ALiBi slopes cut to b's row (per-sequence loops keep each sequence's own slopes)."""
        if self.alibi is not None:
            changes["alibi"] = self.alibi[b:b + 1]
        return dataclasses.replace(self, **changes)

    @property
    def batch(self) -> int:
        return math.prod(self.batch_shape)

    @property
    def group(self) -> int:
        """Query heads per K/V head (1 = MHA, Hq = MQA)."""
        return self.hq // self.hkv

    @property
    def causal_offset(self):
        return masks.causal_offset(self.causal, self.nq, self.nk)

    def q_shape(self):
        return self._shape(self.hq, self.nq)

    def kv_shape(self):
        return self._shape(self.hkv, self.nk)

    def o_shape(self):
        """o's (and do's) shape: q's with v's head dim."""
        return self._shape(self.hq, self.nq, self.dv)

    def v_shape(self):
        return self._shape(self.hkv, self.nk, self.dv)

    def lse_shape(self):
        if self.single_head:
            return (self.nq,)
        return self.batch_shape + (self.hq, self.nq)

    def _shape(self, h, n, d=None):
        d = self.d if d is None else d
        if self.single_head:
            return (n, d)
        tail = (h, n, d) if self.layout == "bhsd" else (n, h, d)
        return self.batch_shape + tail


def _split(name, a, layout):
    """(batch_shape, heads, seq, d) of one input, accepting 2-D (N, d) as one head."""
    if a.ndim < 2:
        raise ValueError(f"{name}: expected at least 2 dimensions (N, d) or (..., H, N, d), got shape {a.shape}")
    if a.ndim == 2:
        return (), 1, a.shape[0], a.shape[1]
    if layout == "bhsd":
        return tuple(a.shape[:-3]), a.shape[-3], a.shape[-2], a.shape[-1]
    return tuple(a.shape[:-3]), a.shape[-2], a.shape[-3], a.shape[-1]


def check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")


def check_scale(scale, d):
    if scale is None:
        return 1.0 / math.sqrt(d) if d > 0 else 1.0
    if not is_real_number(scale):
        raise TypeError(f"scale: expected a real number or None, got {type(scale).__name__}")
    if not (math.isfinite(float(scale)) and float(scale) > 0):
        raise ValueError(f"scale: expected a finite positive number, got {scale!r}")
    return float(scale)


def same_library(named):
    """The shared array namespace of the named arrays, or a TypeError naming the odd one out."""
    xp = None
    first = None
    for name, a in named:
        ns = array_namespace(a)
        if ns is None:
            raise TypeError(
                f"{name}: expected a numpy.ndarray or cupy.ndarray, got {type(a).__module__}.{type(a).__name__}"
            )
        if xp is None:
            xp, first = ns, name
        elif ns is not xp:
            raise TypeError(
                f"{name}: is a {ns.__name__} array but {first} is a {xp.__name__} array; "
                "do not mix NumPy and CuPy inputs"
            )
    if xp is not np:
        devices = {(name, a.device.id) for name, a in named}
        if len({dev for _, dev in devices}) > 1:
            raise ValueError(f"inputs are on different devices: {sorted(devices)}")
    return xp


def check_dtype(named):
    dtype = None
    for name, a in named:
        if a.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{name}: dtype {dtype_name(a.dtype)} is not supported; expected float16, bfloat16 or float32"
            )
        if dtype is None:
            dtype, first = a.dtype, name
        elif a.dtype != dtype:
            raise TypeError(
                f"{name}: dtype {dtype_name(a.dtype)} differs from {first}'s {dtype_name(dtype)}; "
                "all inputs must share one dtype"
            )
    return np.dtype(dtype)


def check_out_dtype(out_dtype) -> bool:
    """attention's out_dtype: None (q's dtype) -> False, float32 -> True, else TypeError."""
    if out_dtype is None:
        return False
    try:
        dt = np.dtype(out_dtype)
    except TypeError:
        raise TypeError(f"out_dtype: expected None or float32, got {out_dtype!r}") from None
    if dt != FLOAT32:
        raise TypeError(f"out_dtype: expected None (q's dtype) or float32, got {dtype_name(dt)}")
    return True


def check_flag(name, value):
    """TypeError unless value is a bool (anything truthy is not: return_lse="no" must not
    quietly return a pair)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")


MAX_HEAD_DIM = 256  # the largest head dim of the kernels' tile tables (plan.schedule.HEAD_DIM_BUCKETS)


def check_head_dim(d: int, name: str = "q"):
    """Every backend takes the head dims the GPU kernels take, 1 to MAX_HEAD_DIM, so that a
    problem that runs on the NumPy backend also runs on the GPU."""
    if d == 0:
        raise ValueError(f"{name}: head dim d must be at least 1")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"{name}: head dim {d} is larger than the largest supported, {MAX_HEAD_DIM}")


# MLA decoding (DeepSeek's latent cache): q's and k's head dim 576, v's 512 (v = k[..., :512]), a few
# query tokens against the cache. The one pair above MAX_HEAD_DIM, and decode-only: a kernel for its
# shapes (attn_decode_mla), no prefill or backward kernel.
MLA_HEAD_DIMS = (576, 512)
MLA_MAX_QUERY_TOKENS = 16  # query tokens per sequence of an MLA decode call (the split-KV decode limit)
MLA_DECODE_ONLY = ("head dims (576, 512) (MLA) are decode-only: at most 16 query tokens, float16 or bfloat16, "
                   "no window, packed sequences, score modifiers or backward")


def check_head_dims(d: int, dv: int, nq: int, dtype, window=None):
    """q's (and k's) head dim d and v's dv: each 1 to MAX_HEAD_DIM, or exactly MLA_HEAD_DIMS in decode
    shapes (nq <= MLA_MAX_QUERY_TOKENS, 16-bit, no window). ValueError / TypeError naming the argument."""
    if (d, dv) == MLA_HEAD_DIMS:
        if nq > MLA_MAX_QUERY_TOKENS:
            raise ValueError(f"q: {MLA_DECODE_ONLY}; got Nq={nq} query tokens")
        if np.dtype(dtype) not in (FLOAT16, BFLOAT16):
            raise TypeError(f"q: {MLA_DECODE_ONLY}; got dtype {dtype_name(dtype)}")
        if window is not None:
            raise ValueError(f"window: {MLA_DECODE_ONLY}")
        return
    if d == MLA_HEAD_DIMS[0]:
        raise ValueError(f"v: with q's head dim {d} (MLA decode) v's head dim must be {MLA_HEAD_DIMS[1]} "
                         f"(v = k[..., :{MLA_HEAD_DIMS[1]}]), got {dv}")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"q: head dim {d} is larger than the largest supported, {MAX_HEAD_DIM} (above it only "
                         f"MLA decode's {MLA_HEAD_DIMS} pair)")
    check_head_dim(d)
    if dv != d:  # v (and o) may be narrower or wider than q and k (MLA: 192 / 128)
        check_head_dim(dv, "v")


def is_mla(p) -> bool:
    """Whether problem p (a Problem, or a description with d and, where it differs, dv) is MLA
    decoding's (576, 512)."""
    return (p.d, getattr(p, "dv", p.d)) == MLA_HEAD_DIMS


def refuse_mla(p, name: str, what: str):
    """ValueError naming `name` where an MLA (576, 512) problem meets an option it does not take."""
    if is_mla(p):
        raise ValueError(f"{name}: {what} - {MLA_DECODE_ONLY}")


def validate_forward(q, k, v, *, causal=False, scale=None, layout="bhsd", window=None, element=None) -> Problem:
    """Check q, k, v and the options; return the Problem or raise ValueError/TypeError.
    ``element``: the inputs' element type when the caller checked their dtypes itself (float8_e4m3fn
    GPU inputs, held as uint8 bits: core.fp8_inputs)."""
    check_layout(layout)
    window = masks.normalize_window(window)
    named = (("q", q), ("k", k), ("v", v))
    xp = same_library(named)
    dtype = check_dtype(named) if element is None else np.dtype(element)
    causal = masks.normalize_causal(causal)
    for name, a in named:  # blame a 0-D/1-D input itself, not the others for differing from it
        if a.ndim < 2:
            raise ValueError(f"{name}: expected at least 2 dimensions (N, d) or (..., H, N, d), got shape {a.shape}")
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(
            f"k, v: expected the same number of dimensions as q ({q.ndim}), got k {k.ndim}, v {v.ndim}"
        )
    qb, hq, nq, d = _split("q", q, layout)
    kb, hkv, nk, dk = _split("k", k, layout)
    vb, hv, nv, dv = _split("v", v, layout)
    axes = "(..., H, N, d)" if layout == "bhsd" else "(..., N, H, d)"
    if kb != qb or vb != qb:
        raise ValueError(f"k, v: batch dimensions {kb}, {vb} must equal q's {qb} (layout {layout} {axes})")
    if dk != d:
        raise ValueError(f"k: head dim {dk} must equal q's head dim {d}")
    if (hv, nv) != (hkv, nk):
        raise ValueError(f"v: heads and length ({hv}, {nv}) must equal k's ({hkv}, {nk})")
    check_head_dims(d, dv, nq, dtype, window)
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"k: number of heads {hkv} must divide q's number of heads {hq} (MQA/GQA)")
    scale = check_scale(scale, d)
    return Problem(xp, layout, qb, hq, hkv, nq, nk, d, dtype, causal, scale, single_head=q.ndim == 2, window=window,
                   head_dim_v=None if dv == d else dv)


def check_softcap(softcap):
    """None (no softcap) or a finite float > 0."""
    if softcap is None:
        return None
    if not is_real_number(softcap):
        raise TypeError(f"softcap: expected a real number or None, got {type(softcap).__name__}")
    if not (math.isfinite(float(softcap)) and float(softcap) > 0):
        raise ValueError(f"softcap: expected a finite number > 0 (None: no softcap), got {softcap!r}")
    return float(softcap)


def _check_mod_array(name, a, xp, device, want_shapes, what):
    if array_namespace(a) is not xp:
        raise TypeError(f"{name}: expected a {xp.__name__}.ndarray like q, got {type(a).__module__}.{type(a).__name__}")
    if a.dtype != np.float32:
        raise TypeError(f"{name}: expected dtype float32, got {dtype_name(a.dtype)}")
    if xp is not np and a.device.id != device:
        raise ValueError(f"{name}: is on device {a.device.id} but q is on device {device}")
    if tuple(a.shape) not in want_shapes:
        raise ValueError(f"{name}: expected shape {' or '.join(str(w) for w in want_shapes)} ({what}), "
                         f"got {tuple(a.shape)}")


def check_score_mods(p: Problem, q, softcap=None, alibi_slopes=None, sinks=None, sequences=None) -> Problem:
    """p with the score modifiers checked and recorded. ``sequences``: the number of packed
    sequences (cu_seqlens_*), which then stand for the batch of the ALiBi slopes.

    alibi_slopes: float32 (Hq,) or (B, Hq) (also q's batch dims + (Hq,)), stored as (B, Hq) (a
    broadcast view of (Hq,)); sinks: float32 (Hq,). Both of q's library and device. Their values
    are not read (a device array would cost a copy): non-finite values give non-finite results."""
    softcap = check_softcap(softcap)
    for name, x in (("softcap", softcap), ("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is not None:
            refuse_mla(p, name, "the MLA decode kernel takes no score modifiers")
    xp = p.xp
    device = None if xp is np else q.device.id
    alibi = None
    if alibi_slopes is not None:
        nb = sequences if sequences is not None else p.batch
        shapes = [(p.hq,), (nb, p.hq)]
        if sequences is None and len(p.batch_shape) > 1:
            shapes.append(p.batch_shape + (p.hq,))
        what = "per query head, or per " + ("packed sequence" if sequences is not None else "batch entry") + \
            " and query head"
        _check_mod_array("alibi_slopes", alibi_slopes, xp, device, shapes, what)
        alibi = xp.broadcast_to(alibi_slopes.reshape(-1, p.hq), (nb, p.hq))
    if sinks is not None:
        _check_mod_array("sinks", sinks, xp, device, [(p.hq,)], "one logit per query head")
    return dataclasses.replace(p, softcap=softcap, alibi=alibi, sinks=sinks)


def check_out(name, out, shape, dtype, xp, inputs):
    """Validate an ``out=`` style argument: right library, shape, dtype, writable, no aliasing."""
    if out is None:
        return
    if array_namespace(out) is not xp:
        raise TypeError(f"{name}: expected a {xp.__name__}.ndarray like the inputs, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype_name(dtype)}, got {dtype_name(out.dtype)}")
    if xp is np and not out.flags.writeable:
        raise ValueError(f"{name}: array is read-only")
    for in_name, a in inputs:
        if may_share_memory(out, a):
            raise ValueError(f"{name}: must not overlap input {in_name}")


def validate_backward(do, q, k, v, o, lse, *, causal=False, scale=None, layout="bhsd", window=None) -> Problem:
    """Check the backward's arguments; the forward's rules plus do/o/lse consistency."""
    p = validate_forward(q, k, v, causal=causal, scale=scale, layout=layout, window=window)
    refuse_mla(p, "q", "no backward")
    same_library((("q", q), ("do", do), ("o", o), ("lse", lse)))
    for name, a in (("do", do), ("o", o)):
        if tuple(a.shape) != p.o_shape():
            what = "q's shape" if p.dv == p.d else "q's shape with v's head dim"
            raise ValueError(f"{name}: expected {what} {p.o_shape()}, got {tuple(a.shape)}")
        if a.dtype != p.dtype:
            raise TypeError(f"{name}: expected dtype {dtype_name(p.dtype)} like q, got {dtype_name(a.dtype)}")
    if tuple(lse.shape) != p.lse_shape():
        raise ValueError(f"lse: expected shape {p.lse_shape()} (..., Hq, Nq), got {tuple(lse.shape)}")
    if lse.dtype != np.float32:
        raise TypeError(f"lse: expected dtype float32, got {dtype_name(lse.dtype)}")
    return p


def stream_is_capturing() -> bool:
    """Whether CuPy's current stream is being captured into a CUDA graph (False without CuPy)."""
    try:
        import cupy

        return bool(cupy.cuda.get_current_stream().is_capturing())
    except Exception:  # noqa: BLE001 - no CuPy, or one without is_capturing: not capturing
        return False


def to_host(a, name: str, why: str):
    """A device array's values on the host (a device-to-host copy), or a ValueError naming the
    argument while the stream is being captured into a CUDA graph, where that copy is illegal
    (CUDA would invalidate the capture with an error that names nothing)."""
    if isinstance(a, np.ndarray):
        return a
    if stream_is_capturing():
        raise ValueError(f"{name}: {why} - a device-to-host copy, which is not allowed while the stream is "
                         "being captured into a CUDA graph")
    return a.get()


_allocations = threading.local()


@contextlib.contextmanager
def caller_owned_allocations():
    """Within it (this thread), CuPy allocates through the caller's allocator (torch's caching
    allocator, for torch calls: cuflash.api.interop), whose CUDA graph captures own the buffers
    a call allocates: no warning under capture."""
    before = getattr(_allocations, "caller", False)
    _allocations.caller = True
    try:
        yield
    finally:
        _allocations.caller = before


def warn_if_capture_unsafe(stacklevel: int = 4):
    """Under CUDA graph capture, cuflash's per-call buffers (lse, split-KV partials, the backward's
    workspace) must belong to the graph: with CuPy's default MemoryPool a buffer freed after the
    call returns to the pool while the graph keeps writing it on every replay. A stream-ordered
    pool (cupy.cuda.MemoryAsyncPool) records them as the graph's own allocations."""
    if getattr(_allocations, "caller", False) or not stream_is_capturing():
        return
    import cupy

    if isinstance(getattr(cupy.cuda.get_allocator(), "__self__", None), cupy.cuda.MemoryAsyncPool):
        return
    import warnings

    warnings.warn("cuflash: capturing a CUDA graph with an allocator other than cupy.cuda.MemoryAsyncPool: the "
                  "buffers a call allocates and frees (lse, split-KV partials, the backward's workspace) go back to "
                  "the pool after capture while the graph keeps writing them on replay; call "
                  "cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc) before capturing",
                  RuntimeWarning, stacklevel=stacklevel)


def check_kv_lens(kv_lens, p: Problem, validate: bool = True):
    """Validate ``kv_lens`` (valid cache length per sequence). Returns (device_or_host_array, host
    int64 array or None). With validate=True a CuPy kv_lens is copied to the host once to check
    0 <= kv_lens <= Nk; validate=False skips that copy (and the check)."""
    if kv_lens is None:
        return None, None
    if array_namespace(kv_lens) is not p.xp:
        raise TypeError(f"kv_lens: expected a {p.xp.__name__}.ndarray like q, got {type(kv_lens).__name__}")
    if kv_lens.dtype != np.int32:
        raise TypeError(f"kv_lens: expected dtype int32, got {dtype_name(kv_lens.dtype)}")
    want = p.batch_shape if not p.single_head else ()
    if tuple(kv_lens.shape) != tuple(want):
        raise ValueError(f"kv_lens: expected shape {tuple(want)} (q's batch dimensions), got {tuple(kv_lens.shape)}")
    host = None
    if validate or p.xp is np:
        host = np.asarray(to_host(kv_lens, "kv_lens", "validate=True checks its values on the host (pass "
                                  "validate=False to capture)")).reshape(-1).astype(np.int64)
        if host.size and (host.min() < 0 or host.max() > p.nk):
            raise ValueError(f"kv_lens: values must lie in [0, Nk={p.nk}], got min {host.min()} max {host.max()}")
    dev = kv_lens.reshape(-1)
    if p.xp is not np:
        import cupy

        dev = cupy.ascontiguousarray(dev)
    return dev, host


def _check_offsets_array(name, c, xp):
    if array_namespace(c) is not xp:
        raise TypeError(f"{name}: expected a {xp.__name__}.ndarray like q, got {type(c).__name__}")
    if c.dtype != np.int32:
        raise TypeError(f"{name}: expected dtype int32, got {dtype_name(c.dtype)}")
    if c.ndim != 1 or c.shape[0] < 1:
        raise ValueError(f"{name}: expected a 1-D array of B + 1 offsets, got shape {tuple(c.shape)}")


def check_offset_values(name, c, total, what):
    """Offsets c (host ints) of a packed array: start at 0, non-decreasing, end at its length."""
    c = np.asarray(c, dtype=np.int64)
    if c.size < 1 or c[0] != 0:
        raise ValueError(f"{name}: expected cumulative offsets starting at 0, got {c[:4].tolist()}...")
    down = np.flatnonzero(np.diff(c) < 0)
    if down.size:
        b = int(down[0])
        raise ValueError(f"{name}: offsets must be non-decreasing, got {name}[{b}] = {c[b]} > "
                         f"{name}[{b + 1}] = {c[b + 1]}")
    if c[-1] != total:
        raise ValueError(f"{name}: last offset {c[-1]} must equal the packed length {total} ({what})")
    return c


def validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, kv_lens=None, grads=None, max_seqlens=(None, None),
                    validate=True, **options):
    """(Problem, spans) of packed sequences: q (total_q, Hq, d), k and v (total_k, Hkv, d).

    The Problem is that of the packed arrays read as "bshd" without a batch axis (so its q_shape
    is q's shape and its lse_shape (Hq, total_q)); spans are (q0, q1, k0, k1) per sequence.
    ``grads``: (do, o, lse) for the backward. The offsets' values are read and checked on the host
    (for CuPy offsets a device-to-host copy): the CPU backend and the reference loop over the
    sequences, and the GPU launch sizes its grid by the longest one. ``max_seqlens``: the caller's
    (max_seqlen_q, max_seqlen_k), each None or an int checked to be at least the longest sequence;
    with both given, ``validate=False`` and offsets on the device, the values are not read and
    spans is None (the grid is sized by the given lengths; see check_max_seqlens)."""
    if kv_lens is not None:
        raise ValueError("kv_lens: cannot be combined with cu_seqlens_q / cu_seqlens_k (give each packed "
                         "sequence its own length through the offsets)")
    if cu_seqlens_q is None or cu_seqlens_k is None:
        missing = "cu_seqlens_q" if cu_seqlens_q is None else "cu_seqlens_k"
        raise ValueError(f"{missing}: packed sequences need both cu_seqlens_q and cu_seqlens_k")
    check_layout(options.pop("layout"))  # a valid value, but packed arrays are always (total, H, d)
    named = (("q", q), ("k", k), ("v", v))
    xp = same_library(named)
    for name, a in named:
        if a.ndim != 3:
            rows = "total_q, Hq" if name == "q" else "total_k, Hkv"
            raise ValueError(f"{name}: with cu_seqlens_q/cu_seqlens_k expected a packed ({rows}, d) array, "
                             f"got shape {tuple(a.shape)}")
    if grads is None:
        p = validate_forward(q, k, v, layout="bshd", **options)
    else:
        do, o, lse = grads
        p = validate_backward(do, q, k, v, o, lse, layout="bshd", **options)
    refuse_mla(p, "cu_seqlens_q", "no packed sequences")
    for name, c in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_offsets_array(name, c, xp)
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_k: expected cu_seqlens_q's shape {tuple(cu_seqlens_q.shape)} (B + 1 offsets "
                         f"for the same B sequences), got {tuple(cu_seqlens_k.shape)}")
    check_flag("validate", validate)
    given = check_max_seqlens(*max_seqlens, packed=True)
    if offsets_unread(given, validate, on_device=xp is not np):
        return p, None
    host = []
    for name, c, total, what in (("cu_seqlens_q", cu_seqlens_q, p.nq, "q.shape[0]"),
                                 ("cu_seqlens_k", cu_seqlens_k, p.nk, "k.shape[0]")):
        host.append(check_offset_values(name, to_host(c, name, "packed sequences are sized on the host (the grid "
                                                          "covers the longest one), so they cannot be captured"),
                                        total, what))
    cq, ck = host
    for name, m, c in (("max_seqlen_q", given[0], cq), ("max_seqlen_k", given[1], ck)):
        longest = int(np.diff(c).max(initial=0))
        if m is not None and m < longest:
            raise ValueError(f"{name}: {m} is less than the longest packed sequence ({longest} rows); the grid "
                             "would leave rows uncomputed")
    return p, tuple(zip(cq[:-1].tolist(), cq[1:].tolist(), ck[:-1].tolist(), ck[1:].tolist()))


def check_max_seqlens(max_seqlen_q=None, max_seqlen_k=None, *, packed: bool):
    """(max_seqlen_q, max_seqlen_k) as ints or None: FlashAttention's varlen arguments, the longest
    packed q and k sequences. Given with cu_seqlens_* and validate=False (device offsets), they
    size the GPU's grid so that no offset is read on the host (a call CUDA graphs can capture);
    the offsets are then the caller's promise: they are clamped into the packed arrays on the
    device before any kernel reads them, and rows of a q sequence longer than max_seqlen_q are not
    computed."""
    given = []
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if m is not None:
            if not packed:
                raise ValueError(f"{name}: only with cu_seqlens_q / cu_seqlens_k (packed sequences)")
            if isinstance(m, (bool, np.bool_)) or not isinstance(m, (int, np.integer)):
                raise TypeError(f"{name}: expected an int, got {type(m).__name__}")
            if m < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {m}")
            m = int(m)
        given.append(m)
    return tuple(given)


def offsets_unread(max_seqlens, validate: bool, on_device: bool) -> bool:
    """Whether a packed call leaves its offsets unread on the host: both of the checked
    (max_seqlen_q, max_seqlen_k) given, validate=False, offsets on the device."""
    return on_device and not validate and None not in max_seqlens


def longest_sequences(spans, max_seqlens=(None, None)):
    """(rows of the longest q sequence, of the longest k sequence) that a packed launch's grids
    cover: the caller's checked max_seqlen_q / max_seqlen_k where given, else read from spans
    (None only when both are given)."""
    max_q, max_k = max_seqlens
    if max_q is None:
        max_q = max((q1 - q0 for q0, q1, _, _ in spans), default=0)
    if max_k is None:
        max_k = max((k1 - k0 for _, _, k0, k1 in spans), default=0)
    return max_q, max_k


def sequences(p: Problem, spans):
    """(problem of one packed sequence, its rows of q/o/lse, its rows of k/v) for each span."""
    for b, (q0, q1, k0, k1) in enumerate(spans):
        yield p.sequence(b, nq=q1 - q0, nk=k1 - k0), slice(q0, q1), slice(k0, k1)


def validate_paged(q, k_cache, v_cache, block_table, *, causal=False, scale=None, layout="bhsd", window=None):
    """Check a paged-cache call: q (B, Hq, Nq, d) ("bhsd") or (B, Nq, Hq, d) ("bshd"), caches
    (num_blocks, block_size, Hkv, d), block_table int32 (B, max_blocks). Returns (Problem with
    Nk = max_blocks * block_size, block_size). Table values are checked by check_block_table."""
    check_layout(layout)
    window = masks.normalize_window(window)
    named = (("q", q), ("k", k_cache), ("v", v_cache))
    xp = same_library(named)
    dtype = check_dtype(named)
    if q.ndim != 4:
        raise ValueError(f"q: with block_table expected 4 dimensions (B, Hq, Nq, d) or (B, Nq, Hq, d), got shape {q.shape}")
    for name, a in named[1:]:
        if a.ndim != 4:
            raise ValueError(f"{name}: with block_table expected a paged cache (num_blocks, block_size, Hkv, d), got shape {a.shape}")
    if v_cache.shape[:-1] != k_cache.shape[:-1]:
        raise ValueError(f"v: shape {v_cache.shape} must equal k's {k_cache.shape} but for the head dim (paged caches)")
    (qb,), hq, nq, d = _split("q", q, layout)
    nb, bs, hkv, dk = k_cache.shape
    dv = v_cache.shape[-1]
    if dv != dk and (dk, dv) != MLA_HEAD_DIMS:
        raise ValueError(f"v: shape {v_cache.shape} must equal k's {k_cache.shape} (paged caches; only MLA's "
                         f"{MLA_HEAD_DIMS} head dims differ)")
    if dk != d:
        raise ValueError(f"k: head dim {dk} must equal q's head dim {d}")
    if bs < 16 or bs & (bs - 1):
        raise ValueError(f"k: block_size (axis 1) must be a power of two >= 16, got {bs}")
    if nb == 0:
        raise ValueError("k: the paged cache holds no blocks (axis 0 is 0)")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"k: number of heads {hkv} must divide q's number of heads {hq} (MQA/GQA)")
    if array_namespace(block_table) is not xp:
        raise TypeError(f"block_table: expected a {xp.__name__}.ndarray like q, got {type(block_table).__name__}")
    if block_table.dtype != np.int32:
        raise TypeError(f"block_table: expected dtype int32, got {dtype_name(block_table.dtype)}")
    if block_table.ndim != 2 or block_table.shape[0] != qb:
        raise ValueError(f"block_table: expected shape ({qb}, max_blocks) (q's batch, pages per sequence), "
                         f"got {tuple(block_table.shape)}")
    check_head_dims(d, dv, nq, dtype, window)
    scale = check_scale(scale, d)
    nk = block_table.shape[1] * bs
    return Problem(xp, layout, (qb,), hq, hkv, nq, nk, d, dtype, masks.normalize_causal(causal), scale,
                   window=window, head_dim_v=None if dv == d else dv), bs


def check_block_table(block_table, lens_host, block_size, num_blocks):
    """The pages each sequence uses (the first ceil(kv_lens[b] / block_size) entries of its row)
    must index the cache; unused entries are never read and may hold anything (e.g. -1).
    Returns the table on the host (int64)."""
    table = np.asarray(to_host(block_table, "block_table", "validate=True checks the used pages on the host (pass "
                               "validate=False to capture)")).astype(np.int64)
    for b, n in enumerate(lens_host):
        used = table[b, : -(-int(n) // block_size)]
        if used.size and (used.min() < 0 or used.max() >= num_blocks):
            bad = used[(used < 0) | (used >= num_blocks)][0]
            raise ValueError(f"block_table: sequence {b} uses page {int(bad)}, outside the cache's "
                             f"[0, {num_blocks}) blocks")
    return table
