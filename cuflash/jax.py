"""JAX adapter: ``cuflash.jax.attention``, differentiable (``jax.custom_vjp``) and usable inside ``jax.jit``.

How it runs. Both passes go through ``jax.experimental.buffer_callback``: at execution time XLA
calls back into Python with its own buffers (inputs to read, outputs to fill) and, on a GPU, its
compute stream. The callback wraps the buffers as CuPy arrays over the same memory (DLPack) and
launches cuflash's CUDA kernels on XLA's stream, on the buffers' device; on a CPU backend the
buffers are NumPy arrays and the NumPy backend fills them. Hence:

* works eagerly and inside ``jax.jit``, ``jax.grad`` / ``jax.vjp`` and ``jax.vmap`` (mapped axes
  become leading batch axes, which cuflash treats as batch);
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

from .core import problem
from .api import functional as api
from .api import interop

__all__ = ["attention"]

_DL_CUDA = 2


def _problem_of(q, k, v, causal, scale, layout):
    """Validate shapes/dtypes/options on zero-stride stand-ins (works on tracers too)."""
    stand_ins = [np.broadcast_to(np.zeros((), dtype=np.dtype(a.dtype)), a.shape) for a in (q, k, v)]
    return problem.validate_forward(*stand_ins, causal=causal, scale=scale, layout=layout)


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


@functools.lru_cache(maxsize=None)
def _forward_callback(causal, scale, layout):
    """One callback object per option set, so JAX's compilation caches see the same function."""

    def callback(ctx, outs, q, k, v):
        o_buf, lse_buf = outs
        with _Native(ctx, q) as native:
            qn, kn, vn, on, lsen = (native.wrap(b) for b in (q, k, v, o_buf, lse_buf))
            _, lse = api.attention(qn, kn, vn, causal=causal, scale=scale, layout=layout, return_lse=True, out=on)
            lsen[...] = lse

    return callback


@functools.lru_cache(maxsize=None)
def _backward_callback(causal, scale, layout):
    def callback(ctx, outs, do, q, k, v, o, lse):
        with _Native(ctx, q) as native:
            args = [native.wrap(b) for b in (do, q, k, v, o, lse)]
            grads = tuple(native.wrap(b) for b in outs)
            api.attention_backward(*args, causal=causal, scale=scale, layout=layout, out=grads)

    return callback


def _forward(q, k, v, causal, scale, layout):
    p = _problem_of(q, k, v, causal, scale, layout)
    result = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(p.lse_shape(), jnp.float32))
    call = buffer_callback(_forward_callback(causal, scale, layout), result, vmap_method="broadcast_all")
    return call(q, k, v)


def _backward(do, q, k, v, o, lse, causal, scale, layout):
    result = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
              jax.ShapeDtypeStruct(v.shape, v.dtype))
    call = buffer_callback(_backward_callback(causal, scale, layout), result, vmap_method="broadcast_all")
    return call(do, q, k, v, o, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q, k, v, causal, scale, layout):
    return _forward(q, k, v, causal, scale, layout)[0]


def _attention_fwd(q, k, v, causal, scale, layout):
    o, lse = _forward(q, k, v, causal, scale, layout)
    return o, (q, k, v, o, lse)


def _attention_bwd(causal, scale, layout, saved, do):
    q, k, v, o, lse = saved
    return _backward(do.astype(q.dtype), q, k, v, o, lse, causal, scale, layout)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q, k, v, *, causal=False, scale=None, layout="bhsd"):
    """``cuflash.attention`` for JAX: differentiable, and usable inside ``jax.jit`` / ``vmap``.

    Same arguments and semantics as :func:`cuflash.attention` (causal False / True /
    "bottom_right" / "top_left"; layout "bhsd" or "bshd"; GQA; float16, bfloat16, float32 on
    CPU; float16 and bfloat16 for the GPU backward). Returns o, a jax.Array of q's dtype. See the
    module docstring for how it runs and what it does not support.
    """
    q, k, v = (jnp.asarray(a) for a in (q, k, v))
    p = _problem_of(q, k, v, causal, scale, layout)  # errors surface here, naming the argument
    causal = p.causal  # None / "bottom_right" / "top_left": hashable, and what the kernels take
    if p.single_head:  # (N, d) -> (1, N, d): leading axes are then batch axes under vmap too
        return _attention(q[None], k[None], v[None], causal or False, p.scale, "bhsd")[0]
    return _attention(q, k, v, causal or False, p.scale, layout)
