"""JAX adapter: ``cuflash.jax.attention``, differentiable (``jax.custom_vjp``) and usable inside ``jax.jit``.

How it runs. Both passes go through ``jax.experimental.buffer_callback``: at execution time XLA
calls back into Python with its own buffers (inputs to read, outputs to fill) and, on a GPU, its
compute stream. The callback wraps the buffers as CuPy arrays over the same memory (DLPack) and
launches cuflash's CUDA kernels on XLA's stream, on the buffers' device; on a CPU backend the
buffers are NumPy arrays and the NumPy backend fills them. Hence:

* works eagerly and inside ``jax.jit``, ``jax.grad`` / ``jax.vjp`` and ``jax.vmap`` (mapped axes
  become leading batch axes, which cuflash treats as batch), and per device inside
  ``jax.shard_map`` (results vary over the mesh axes their inputs vary over);
* no copies of q, k, v, do, o: o and dq, dk, dv are written in place into XLA's output buffers;
  the float32 lse (4 bytes per query row) is copied once into its buffer;
* ordering: the kernels run on XLA's stream, so they follow the producers of their inputs and
  precede the consumers of their outputs like any XLA op.

What does not work, and why:

* forward-mode AD (``jax.jvp``, ``jax.jacfwd``): ``custom_vjp`` defines reverse mode only;
* the NumPy-style ``cuflash.attention(jax_array, ...)`` takes concrete arrays only: it converts its
  inputs through DLPack at call time, which a tracer cannot do; under ``jit`` it raises TypeError
  pointing here. Outside jit it works and returns jax.Arrays over cuflash's memory (no copy), but
  it has no gradient - this module is the differentiable, jit-able path;
* ``buffer_callback`` is experimental in JAX; without it (old JAX) this module raises ImportError;
* XLA's GPU client preallocates most of the GPU's memory by default, while CuPy allocates the
  kernels' scratch (lse, the backward's float32 dQ accumulator) from its own pool: set
  ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (or a smaller ``XLA_PYTHON_CLIENT_MEM_FRACTION``) before
  JAX starts;
* callbacks are excluded from CUDA-graph command buffers (``command_buffer_compatible=False``):
  Python runs on every execution, costing a few microseconds of host time per call.

Imported only on request (``import cuflash.jax``): ``import cuflash`` never imports JAX.
"""

from __future__ import annotations

import functools

try:
    import jax
    import jax.numpy as jnp
except ImportError as exc:  # pragma: no cover - exercised by the optional-import test
    raise ImportError("cuflash.jax needs JAX (pip install jax); cuflash itself does not") from exc

try:
    from jax.experimental.buffer_callback import buffer_callback
except ImportError as exc:  # pragma: no cover - depends on the installed JAX
    raise ImportError(
        f"cuflash.jax needs jax.experimental.buffer_callback (JAX >= 0.7); this JAX is {jax.__version__}"
    ) from exc

import numpy as np

from .core import masks, problem
from .api import functional as api
from .api import interop

__all__ = ["attention"]

_DL_CUDA = 2


def _problem_of(q, k, v, causal, scale, layout, window=None):
    """Validate shapes/dtypes/options on zero-stride stand-ins (works on tracers too)."""
    stand_ins = [np.broadcast_to(np.zeros((), dtype=np.dtype(a.dtype)), a.shape) for a in (q, k, v)]
    return problem.validate_forward(*stand_ins, causal=causal, scale=scale, layout=layout, window=window)


class _Native:
    """Inside a callback: XLA's buffers as CuPy (GPU, on XLA's stream and device) or NumPy arrays."""

    def __init__(self, ctx, first_buffer):
        dev_type, dev_id = first_buffer.__dlpack_device__()
        self.gpu = int(dev_type) == _DL_CUDA
        self.device = int(dev_id)
        self.ctx = ctx
        self._scopes = []

    def __enter__(self):
        if self.gpu:
            import cupy

            device = cupy.cuda.Device(self.device)
            device.__enter__()
            stream = interop.external_stream(int(self.ctx.stream), self.device)
            stream.__enter__()
            self._scopes = [stream, device]
        return self

    def __exit__(self, *exc):
        for scope in self._scopes:
            scope.__exit__(*exc)
        self._scopes = []
        return False

    def wrap(self, buf):
        if self.gpu:
            import cupy

            return cupy.from_dlpack(buf)  # XLA's Buffer exports no stream work: we are on its stream
        return np.asarray(buf)


_ARRAY_OPTIONS = ("kv_lens", "cu_seqlens_q", "cu_seqlens_k", "block_table")
_MOD_ARRAYS = ("alibi_slopes", "sinks")  # float32 arrays of the score modifiers


def _lse_shape(q, p, varlen, paged, layout):
    """The float32 lse's shape as cuflash returns it: (Hq, total_q) packed, else p.lse_shape()
    (a paged call's q is (B, Hq, Nq, d) or (B, Nq, Hq, d))."""
    if varlen:
        return (q.shape[1], q.shape[0])
    if paged:
        b, h, n = (q.shape[0], q.shape[1], q.shape[2]) if layout == "bhsd" else (q.shape[0], q.shape[2], q.shape[1])
        return (b, h, n)
    return p.lse_shape()


@functools.lru_cache(maxsize=None)
def _forward_callback(options, names):
    """One callback object per option set, so JAX's compilation caches see the same function.
    ``options``: (causal, scale, layout, window, validate, softcap, max_seqlen_q, max_seqlen_k);
    ``names``: the array options given, passed after q, k, v."""
    causal, scale, layout, window, validate, softcap, max_q, max_k = options

    def callback(ctx, outs, q, k, v, *arrays):
        o_buf, lse_buf = outs
        with _Native(ctx, q) as native:
            qn, kn, vn, on, lsen = (native.wrap(b) for b in (q, k, v, o_buf, lse_buf))
            given = {n: native.wrap(b) for n, b in zip(names, arrays)}
            _, lse = api.attention(qn, kn, vn, causal=causal, scale=scale, layout=layout, window=window,
                                   validate=validate, return_lse=True, out=on, softcap=softcap, max_seqlen_q=max_q,
                                   max_seqlen_k=max_k, **given)
            lsen[...] = lse

    return callback


@functools.lru_cache(maxsize=None)
def _backward_callback(options, names, deterministic):
    causal, scale, layout, window, validate, softcap, max_q, max_k = options

    def callback(ctx, outs, do, q, k, v, o, lse, *arrays):
        with _Native(ctx, q) as native:
            args = [native.wrap(b) for b in (do, q, k, v, o, lse)]
            grads = tuple(native.wrap(b) for b in outs)
            given = {n: native.wrap(b) for n, b in zip(names, arrays)}
            result = api.attention_backward(*args, causal=causal, scale=scale, layout=layout, window=window,
                                            deterministic=deterministic, out=grads[:3], softcap=softcap,
                                            max_seqlen_q=max_q, max_seqlen_k=max_k, validate=validate, **given)
            if "sinks" in given:  # dsinks comes back as a fresh array: into XLA's buffer
                grads[3][...] = result[3]

    return callback


def _vmap_method(names):
    # Packed sequences and paged caches have no batch axis to add, and per-head slopes and sinks
    # must keep their shapes: map such calls one at a time.
    return "sequential" if ({"cu_seqlens_q", "block_table", *_MOD_ARRAYS} & set(names)) else "broadcast_all"


def _varying_axes(x) -> frozenset:
    """The mesh axes x varies over inside ``shard_map`` (empty outside, or on a JAX without them)."""
    t = jax.typeof(x)
    manual = getattr(t, "manual_axis_type", None)  # JAX >= 0.10
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(t, "vma", ()) or ())  # JAX 0.6 - 0.9


def _varying_like(outputs, inputs):
    """Inside ``shard_map``, a callback's results carry no manual-axis type: mark them varying over
    the mesh axes their inputs vary over, as per-device values are. A custom_vjp whose gradients
    are typed unlike its primals (varying) is refused, and lax.switch needs its branches typed
    alike (cuflash.jax_distributed)."""
    if not hasattr(jax, "typeof"):  # a JAX without manual-axis types
        return outputs
    vma = frozenset().union(*(_varying_axes(x) for x in inputs))
    out = []
    for y in outputs:
        missing = tuple(sorted(vma - _varying_axes(y)))
        if missing and hasattr(jax.lax, "pcast"):  # JAX >= 0.8.2
            y = jax.lax.pcast(y, missing, to="varying")
        elif missing:
            y = jax.lax.pvary(y, missing)
        out.append(y)
    return tuple(out)


def _forward(q, k, v, arrays, static):
    options, names, lse_shape, _ = static
    o_shape = (*q.shape[:-1], v.shape[-1])  # v's head dim may differ from q's
    result = (jax.ShapeDtypeStruct(o_shape, q.dtype), jax.ShapeDtypeStruct(lse_shape, jnp.float32))
    call = buffer_callback(_forward_callback(options, names), result, vmap_method=_vmap_method(names))
    return _varying_like(call(q, k, v, *arrays), (q, k, v, *arrays))


def _backward(do, q, k, v, o, lse, arrays, static):
    options, names, _, deterministic = static
    result = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
              jax.ShapeDtypeStruct(v.shape, v.dtype))
    if "sinks" in names:
        result += (jax.ShapeDtypeStruct(arrays[names.index("sinks")].shape, jnp.float32),)
    call = buffer_callback(_backward_callback(options, names, deterministic), result, vmap_method=_vmap_method(names))
    return _varying_like(call(do, q, k, v, o, lse, *arrays), (do, q, k, v, o, lse, *arrays))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, arrays, static):
    return _forward(q, k, v, arrays, static)


def _attention_fwd(q, k, v, arrays, static):
    names = static[1]
    for name in ("kv_lens", "block_table"):
        if name in names:
            raise ValueError(f"{name}: KV-cache calls have no backward; differentiate a call without it")
    o, lse = _forward(q, k, v, arrays, static)
    return (o, lse), (q, k, v, o, lse, arrays)


def _attention_bwd(static, saved, cotangents):
    q, k, v, o, lse, arrays = saved
    do = cotangents[0]  # lse is returned under stop_gradient: its cotangent is zero
    grads = _backward(do.astype(q.dtype), q, k, v, o, lse, arrays, static)
    # Only the sinks have a gradient among the array options (ALiBi slopes are not trained).
    names = static[1]
    return (*grads[:3], tuple(grads[3] if n == "sinks" else None for n in names))


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q, k, v, *, causal=False, scale=None, layout="bhsd", return_lse=False, kv_lens=None, validate=True,
              window=None, cu_seqlens_q=None, cu_seqlens_k=None, block_table=None, deterministic=False, softcap=None,
              alibi_slopes=None, sinks=None, max_seqlen_q=None, max_seqlen_k=None):
    """``cuflash.attention`` for JAX: differentiable, and usable inside ``jax.jit`` / ``vmap``.

    Same arguments and semantics as :func:`cuflash.attention` (causal False / True /
    "bottom_right" / "top_left"; layout "bhsd" or "bshd"; GQA; ``window``; ``kv_lens``;
    ``block_table`` paged caches; ``cu_seqlens_q`` / ``cu_seqlens_k`` packed sequences with
    ``max_seqlen_q`` / ``max_seqlen_k`` (static ints; with validate=False the GPU reads no offset
    on the host); ``validate``; ``return_lse``; the score modifiers ``softcap``, ``alibi_slopes``, ``sinks``;
    float16, bfloat16, float32 on CPU; float16 and bfloat16 for the GPU backward). The options
    other than arrays are static: under ``jax.jit`` pass them as Python values (a closure or
    ``static_argnames``); kv_lens, block_table and cu_seqlens_* (int32) and alibi_slopes and
    sinks (float32) are arrays and may be traced. Returns o (and the float32 lse), jax.Arrays.
    ``sinks`` gets its gradient; ``alibi_slopes`` none.

    Gradients: reverse mode (``jax.grad``, ``jax.vjp``) for q, k, v, with ``window`` and
    ``cu_seqlens_*`` too (``deterministic`` goes to the backward); KV-cache calls (kv_lens,
    block_table) have none (ValueError when differentiated); lse is returned under
    ``stop_gradient``. ``vmap`` adds batch axes (calls with cu_seqlens_* or block_table are mapped
    one call at a time). No ``out=``: JAX arrays are immutable. See the module docstring for how
    it runs and what it does not support.
    """
    problem.check_flag("return_lse", return_lse)
    problem.check_flag("validate", validate)
    problem.check_flag("deterministic", deterministic)
    q, k, v = (jnp.asarray(a) for a in (q, k, v))
    given = {n: a for n, a in zip(_ARRAY_OPTIONS + _MOD_ARRAYS,
                                  (kv_lens, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, sinks))
             if a is not None}
    softcap = problem.check_softcap(softcap)
    for name, a in given.items():
        want = np.float32 if name in _MOD_ARRAYS else np.int32
        if not hasattr(a, "dtype") or not hasattr(a, "shape"):
            raise TypeError(f"{name}: expected a {np.dtype(want).name} array, got {type(a).__name__}")
        if np.dtype(a.dtype) != want:
            raise TypeError(f"{name}: expected dtype {np.dtype(want).name}, got {np.dtype(a.dtype).name}")
    varlen = "cu_seqlens_q" in given or "cu_seqlens_k" in given
    max_seqlens = problem.check_max_seqlens(max_seqlen_q, max_seqlen_k, packed=varlen)
    paged = "block_table" in given
    window = masks.normalize_window(window)
    if varlen or paged:  # shapes that depend on the arrays' values are checked by cuflash when the call runs
        problem.check_layout(layout)
        dims, by = (3, "cu_seqlens_*") if varlen else (4, "block_table")
        for name, a in (("q", q), ("k", k), ("v", v)):
            if a.ndim != dims:
                raise ValueError(f"{name}: expected {dims} dimensions with {by}, got shape {tuple(a.shape)}")
        p = None
        causal = masks.normalize_causal(causal)
        scale = problem.check_scale(scale, q.shape[-1])
    else:
        p = _problem_of(q, k, v, causal, scale, layout, window)  # errors surface here, naming the argument
        mods = {n: np.broadcast_to(np.zeros((), np.float32), given[n].shape) for n in _MOD_ARRAYS if n in given}
        problem.check_score_mods(p, np.zeros(()), **mods)  # the slopes' and sinks' shapes, by name
        causal, scale = p.causal, p.scale
        if p.single_head and not given:  # (N, d) -> (1, N, d): leading axes are then batch axes under vmap too
            o, lse = _attention(q[None], k[None], v[None], (),
                                ((causal or False, scale, "bhsd", window, validate, softcap, None, None), (), (1, p.nq),
                                 deterministic))
            o, lse = o[0], jax.lax.stop_gradient(lse[0])
            return (o, lse) if return_lse else o
    names = tuple(given)
    static = ((causal or False, scale, layout, window, validate, softcap, *max_seqlens), names,
              _lse_shape(q, p, varlen, paged, layout), bool(deterministic))
    o, lse = _attention(q, k, v, tuple(jnp.asarray(a) for a in given.values()), static)
    lse = jax.lax.stop_gradient(lse)
    return (o, lse) if return_lse else o
