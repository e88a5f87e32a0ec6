"""Arrays of other libraries in and out of the public functions: no copies, caller's device and stream.

cuflash computes on NumPy (host) and CuPy (CUDA) arrays. :func:`accepts_foreign_arrays` lets the
public functions also take torch tensors, JAX arrays and anything that exposes ``__dlpack__``,
``__cuda_array_interface__`` or ``__array__`` (Numba device arrays, cuda.core views, ...):

============================  ===============================  ==================================
kind of the inputs            computed on                      results come back as
============================  ===============================  ==================================
torch, CUDA                   CuPy over the same memory        torch (``torch.from_dlpack``)
                              (DLPack), on torch's current
                              stream and the tensors' device
torch, CPU                    NumPy over the same memory       torch (``torch.from_numpy``)
JAX, GPU                      CuPy over the same memory        jax.Array (``jax.dlpack``);
                              (DLPack, stream-synchronized)    eager arrays only, see cuflash.jax
JAX, CPU                      NumPy (``np.asarray``)           jax.Array on the input's device
other GPU arrays              CuPy (DLPack, else the CUDA      CuPy
                              array interface)
other host arrays             NumPy (DLPack, else __array__)   NumPy
============================  ===============================  ==================================

bfloat16 travels as DLPack's bfloat16 code (CuPy >= 14 maps it to ml_dtypes.bfloat16); where an
exporter or importer refuses it, the same bytes travel as int16 and are viewed back - still no copy,
except for a bfloat16 result handed to JAX that way, which costs one device-side bitcast.

The NumPy-style functions drop torch's autograd history (results do not require grad):
``cuflash.torch.attention`` is the differentiable path, ``cuflash.jax.attention`` JAX's.

Streams: torch inputs run on ``torch.cuda.current_stream(device)``, made CuPy's current stream for
the call (``external_stream``); CuPy inputs run on CuPy's current stream; for JAX and
other DLPack producers the protocol itself orders the producer's pending work before CuPy's
current stream and the consumer's work after it. Memory a call allocates (outputs, scratch) comes
from torch's caching allocator for torch inputs (so torch's CUDA graph captures own it) and from
CuPy's pool otherwise, on the call's stream: as with torch's allocator, a result used on another
stream must be kept alive until that stream is done with it.

Devices: all inputs must live on one device (else ValueError); the call runs inside
``cupy.cuda.Device(n)`` so allocations, compiled modules (cached per device by kernels.build) and launches
are on device n.

Mixing kinds (say a torch tensor and a CuPy array) raises TypeError naming the odd argument. torch
and JAX are never imported here: a tensor can only exist once its library is imported, so the
checks look the library up in ``sys.modules``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from dataclasses import dataclass

import numpy as np

from ..core import problem as _problem
from ..core.arrays import BFLOAT16, is_cupy_array

# DLPack device types (dlpack.h).
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13

NUMPY, CUPY, TORCH, JAX = "numpy", "cupy", "torch", "jax"
GPU_PROTOCOL, HOST_PROTOCOL = "gpu-protocol", "host-protocol"  # unnamed producers: results are CuPy / NumPy

_KIND_WORDS = {
    NUMPY: "a NumPy array",
    CUPY: "a CuPy array",
    TORCH: "a torch tensor",
    JAX: "a JAX array",
    GPU_PROTOCOL: "a GPU array of another library (DLPack / CUDA array interface)",
    HOST_PROTOCOL: "a host array of another library (DLPack / __array__)",
}


@dataclass(frozen=True)
class Placement:
    """Where one argument lives: its kind (which decides the result's kind) and CUDA device."""

    kind: str
    device: int | None  # CUDA ordinal; None for host memory

    def where(self) -> str:
        return "cpu" if self.device is None else f"cuda:{self.device}"


def _type_name(x) -> str:
    t = type(x)
    return f"{t.__module__}.{t.__qualname__}"


def _loaded(module_name):
    """The module if the program already imported it, else None (never imports it)."""
    return sys.modules.get(module_name)


def _pointer_device(ptr: int) -> int:
    """CUDA ordinal owning a device pointer (for __cuda_array_interface__ producers)."""
    import cupy

    if ptr == 0:  # empty arrays may carry a null pointer: any device will do
        return cupy.cuda.runtime.getDevice()
    return int(cupy.cuda.runtime.pointerGetAttributes(ptr).device)


def _is_tracer(jax, x) -> bool:
    tracer = getattr(jax.core, "Tracer", None)
    if tracer is None:  # moved in some JAX versions
        from jax._src.core import Tracer as tracer
    return isinstance(x, tracer)


def _dlpack_placement(name, x, kind_gpu, kind_host) -> Placement:
    try:
        dev_type, dev_id = x.__dlpack_device__()
    except Exception as exc:  # e.g. JAX arrays sharded over several devices raise BufferError
        raise TypeError(f"{name}: cannot be shared through DLPack ({type(exc).__name__}: {exc})") from None
    dev_type = int(dev_type)
    if dev_type in (_DL_CUDA, _DL_CUDA_MANAGED):
        return Placement(kind_gpu, int(dev_id))
    if dev_type in (_DL_CPU, _DL_CUDA_HOST):
        return Placement(kind_host, None)
    raise TypeError(
        f"{name}: {_type_name(x)} lives on DLPack device type {dev_type}; cuflash runs on CUDA devices and the CPU"
    )


def placement(name, x) -> Placement | None:
    """Kind and device of one argument; None for objects that are no array at all."""
    if isinstance(x, (np.ndarray, np.generic)):  # (a NumPy scalar: the array check then names it by its type)
        return Placement(NUMPY, None)
    if is_cupy_array(x):
        return Placement(CUPY, int(x.device.id))
    torch = _loaded("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type == "cuda":
            return Placement(TORCH, int(x.device.index))
        if x.device.type == "cpu":
            return Placement(TORCH, None)
        raise TypeError(f"{name}: torch tensors on device {x.device.type!r} are not supported (CUDA or CPU)")
    jax = _loaded("jax")
    if jax is not None and isinstance(x, jax.Array):
        if _is_tracer(jax, x):
            raise TypeError(
                f"{name}: got a JAX tracer (inside jax.jit, grad or vmap); cuflash.attention takes concrete "
                "arrays only - use cuflash.jax.attention, which runs inside jit through XLA's buffers"
            )
        return _dlpack_placement(name, x, JAX, JAX)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return _dlpack_placement(name, x, GPU_PROTOCOL, HOST_PROTOCOL)
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        return Placement(GPU_PROTOCOL, _pointer_device(int(cai["data"][0])))
    if hasattr(x, "__array__") or hasattr(x, "__array_interface__"):
        return Placement(HOST_PROTOCOL, None)
    return None


def common_placement(named) -> Placement:
    """The one placement of all named arguments, or TypeError (kinds) / ValueError (devices)."""
    first_name, first = None, None
    for name, x in named:
        pl = placement(name, x)
        if pl is None:
            raise TypeError(
                f"{name}: expected an array (NumPy, CuPy, torch, JAX, or an object exposing __dlpack__, "
                f"__cuda_array_interface__ or __array__), got {_type_name(x)}"
            )
        if first is None:
            first_name, first = name, pl
            continue
        if pl.kind != first.kind:
            raise TypeError(
                f"{name}: is {_KIND_WORDS[pl.kind]} but {first_name} is {_KIND_WORDS[first.kind]}; "
                "pass arrays of one library"
            )
        if pl.device != first.device:
            raise ValueError(
                f"{name}: is on {pl.where()} but {first_name} is on {first.where()}; "
                "all arrays must live on one device"
            )
    return first


# ----------------------------------------------------------------------------- conversions


_TORCH_DTYPES = {}  # torch dtype -> NumPy dtype of the same bytes, filled on first use


def _numpy_dtype_of(torch, dtype):
    if not _TORCH_DTYPES:
        _TORCH_DTYPES.update({torch.float16: np.dtype(np.float16), torch.bfloat16: BFLOAT16,
                              torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
                              torch.int8: np.dtype(np.int8), torch.int16: np.dtype(np.int16),
                              torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64),
                              torch.uint8: np.dtype(np.uint8), torch.bool: np.dtype(np.bool_)})
    return _TORCH_DTYPES.get(dtype)


def _cupy_view_of_torch(t, dtype):
    """A CuPy array over a CUDA tensor's memory, built from its pointer, shape and strides.

    The same view cupy.from_dlpack makes, for about a tenth of its host time (DLPack's capsule,
    torch's __dlpack__ stream checks). Only called on torch's current stream (ForeignCall), where
    DLPack's stream handshake has nothing to order. The tensor is the memory's owner, kept alive by
    the view as DLPack keeps it."""
    import cupy

    itemsize = dtype.itemsize
    strides = t.stride()
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, strides))  # elements; torch strides are >= 0
    mem = cupy.cuda.UnownedMemory(t.data_ptr(), extent * itemsize, t, t.device.index)
    return cupy.ndarray(tuple(t.shape), dtype, cupy.cuda.MemoryPointer(mem, 0), tuple(s * itemsize for s in strides))


def _import_torch(t):
    """torch tensor -> NumPy/CuPy array over the same memory (autograd history is dropped)."""
    torch = _loaded("torch")
    if t.requires_grad:
        t = t.detach()
    if t.is_conj() or t.is_neg():  # lazy conjugate / negative views: materialize them
        t = t.resolve_conj().resolve_neg()
    if t.device.type == "cpu":
        if t.dtype == torch.bfloat16:  # NumPy has no bfloat16: reinterpret the bytes
            return t.view(torch.int16).numpy().view(BFLOAT16)
        return t.numpy()
    dtype = _numpy_dtype_of(torch, t.dtype)
    if dtype is not None and t.numel() > 0:
        return _cupy_view_of_torch(t, dtype)
    import cupy

    try:
        return cupy.from_dlpack(t)
    except (TypeError, BufferError, NotImplementedError):
        if t.dtype != torch.bfloat16:
            raise
        return cupy.from_dlpack(t.view(torch.int16)).view(BFLOAT16)


def _export_torch(a):
    torch = _loaded("torch")
    if isinstance(a, np.ndarray):
        if a.dtype == BFLOAT16:
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)
    try:
        return torch.from_dlpack(a)
    except (TypeError, BufferError, RuntimeError):
        if a.dtype != BFLOAT16:
            raise
        return torch.from_dlpack(a.view(np.int16)).view(torch.bfloat16)


def _import_gpu_protocol(x):
    import cupy

    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return cupy.from_dlpack(x)
    return cupy.asarray(x)  # __cuda_array_interface__: wraps the pointer, no copy


def _import_host_protocol(x, output):
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        try:
            return np.from_dlpack(x)
        except (TypeError, BufferError, RuntimeError):
            if output:  # __array__ might copy, and the result would be written into the copy
                raise
            # e.g. bfloat16, which NumPy's DLPack importer lacks: fall back to __array__
    return np.asarray(x)


def _export_jax(a, device):
    jax = _loaded("jax")
    if isinstance(a, np.ndarray):
        return jax.device_put(a, device)
    try:
        return jax.dlpack.from_dlpack(a)
    except (TypeError, BufferError, RuntimeError):
        if a.dtype != BFLOAT16:
            raise
        bits = jax.dlpack.from_dlpack(a.view(np.int16))
        return jax.lax.bitcast_convert_type(bits, jax.numpy.bfloat16)  # one device copy


class _StreamHandle:
    """A raw cudaStream_t in the CUDA stream protocol, which cupy.cuda.Stream.from_external takes."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def external_stream(ptr: int, device: int):
    """A CuPy stream for another library's cudaStream_t (0: the legacy default stream).

    CuPy >= 14 deprecates ExternalStream (a DeprecationWarning per call, an error under -W error)
    for Stream.from_external; older CuPy has only ExternalStream."""
    import cupy

    if not ptr:
        return cupy.cuda.Stream.null
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamHandle(ptr))
    return cupy.cuda.ExternalStream(ptr, device)


class ForeignCall:
    """One call with foreign arrays: context (device, stream), imports, and exports of results."""

    def __init__(self, where: Placement):
        self.placement = where
        self._originals = {}  # id(native array) -> caller's object, for out= arguments
        self._stack = contextlib.ExitStack()
        self._jax_device = None

    @property
    def on_gpu(self) -> bool:
        return self.placement.device is not None

    def __enter__(self):
        dev = self.placement.device
        if dev is not None:
            import cupy

            self._stack.enter_context(cupy.cuda.Device(dev))
            if self.placement.kind == TORCH:
                self._stack.enter_context(self._torch_stream(dev))
                self._stack.enter_context(self._torch_allocations(dev))
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)

    @staticmethod
    @contextlib.contextmanager
    def _torch_stream(dev):
        """Make torch's current stream on ``dev`` CuPy's current stream for the call."""
        import cupy

        torch = _loaded("torch")
        with external_stream(torch.cuda.current_stream(dev).cuda_stream, dev):
            yield

    @staticmethod
    @contextlib.contextmanager
    def _torch_allocations(dev):
        """CuPy allocates the call's buffers (o, lse, split-KV partials, workspaces) from torch's
        caching allocator on torch's current stream: a CUDA graph torch captures (torch.cuda.graph,
        torch.compile(mode="reduce-overhead")) owns them, where CuPy's pool would take them back
        after capture while the graph keeps writing them; outside capture they return to torch's
        pool when the call's arrays die, like any torch temporary, and one pool serves both."""
        import cupy

        torch = _loaded("torch")
        device = torch.device("cuda", dev)

        def malloc(size):
            t = torch.empty((max(size, 1),), dtype=torch.uint8, device=device)
            return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(t.data_ptr(), size, t, dev), 0)

        with cupy.cuda.using_allocator(malloc), _problem.caller_owned_allocations():
            yield

    def to_native(self, name, x, output=False):
        """The caller's array as a NumPy/CuPy array over the same memory.

        ``output``: the array will be written (out=), so it must be a view, never a copy."""
        kind = self.placement.kind
        if output and kind == JAX:
            raise TypeError(f"{name}: JAX arrays are immutable, so out= cannot be one; leave it None")
        if output and kind == HOST_PROTOCOL and not hasattr(x, "__dlpack__"):
            raise TypeError(
                f"{name}: {_type_name(x)} exposes only __array__, which may copy; out= needs an array "
                "written in place (NumPy, CuPy, torch, or a DLPack producer)"
            )
        if kind in (NUMPY, CUPY):
            native = x
        elif kind == TORCH:
            native = _import_torch(x)
        elif kind == JAX:
            if self._jax_device is None:
                (self._jax_device,) = x.devices()
            if self.on_gpu:
                import cupy

                native = cupy.from_dlpack(x)
            else:
                native = np.asarray(x)
        elif kind == GPU_PROTOCOL:
            native = _import_gpu_protocol(x)
        else:
            native = _import_host_protocol(x, output)
        return native

    def keep_identity(self, native, original):
        """Results that are this native array (out=) come back as the caller's own object."""
        self._originals[id(native)] = original

    def export(self, result):
        """Map a result (array, or tuple of arrays) back to the caller's kind of array."""
        if isinstance(result, tuple):
            return tuple(self.export(r) for r in result)
        if result is None:
            return None
        original = self._originals.get(id(result))
        if original is not None:
            return original
        kind = self.placement.kind
        if kind == TORCH:
            return _export_torch(result)
        if kind == JAX:
            return _export_jax(result, self._jax_device)
        return result  # NumPy / CuPy / protocol producers get NumPy / CuPy


def _flatten(arguments, inputs, outputs):
    """[(display name, array)] of the named arguments; a tuple out= (dq, dk, dv) is expanded."""
    flat = []
    for name in inputs + outputs:
        value = arguments.get(name)
        if value is None:
            continue
        if name in outputs and isinstance(value, tuple):
            flat += [(f"{name}[{i}]", a) for i, a in enumerate(value) if a is not None]
        else:
            flat.append((name, value))
    return flat


def _convert(call, name, value, output):
    """to_native for one argument; out= arrays are remembered so results map back to them."""
    if output and isinstance(value, tuple):
        return tuple(None if a is None else _convert(call, f"{name}[{i}]", a, True) for i, a in enumerate(value))
    native = call.to_native(name, value, output)
    if output:
        call.keep_identity(native, value)
    return native


def _array_arguments(sig, names):
    """A function (args, kwargs) -> {name: value} of the parameters `names` for a plain call
    (positional parameters, then known keywords, every required one given), else None. It stands
    in for Signature.bind, which costs about as much as a decode kernel's launch (~20 us)."""
    params = list(sig.parameters.values())
    kinds = {p.kind for p in params}
    if inspect.Parameter.VAR_POSITIONAL in kinds or inspect.Parameter.VAR_KEYWORD in kinds:
        return lambda args, kwargs: None
    positional = [p.name for p in params
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    keywords = {p.name for p in params if p.kind != inspect.Parameter.POSITIONAL_ONLY}
    required = [p.name for p in params if p.default is inspect.Parameter.empty]
    defaults = {n: sig.parameters[n].default for n in names}
    index = {n: positional.index(n) for n in names if n in positional}

    def arguments(args, kwargs):
        if len(args) > len(positional) or not keywords.issuperset(kwargs):
            return None
        given = set(positional[: len(args)])
        if not given.isdisjoint(kwargs) or any(n not in given and n not in kwargs for n in required):
            return None
        return {n: args[index[n]] if index.get(n, len(args)) < len(args) else kwargs.get(n, defaults[n])
                for n in names}

    def substitute(args, kwargs, values):
        """(args, kwargs) of a plain call (arguments() was not None) with values {name: new} put
        where those parameters were given."""
        args, kwargs = list(args), dict(kwargs)
        for n, value in values.items():
            if index.get(n, len(args)) < len(args):
                args[index[n]] = value
            else:
                kwargs[n] = value
        return args, kwargs

    arguments.substitute = substitute
    return arguments


def accepts_foreign_arrays(*array_params, outputs=()):
    """Decorate a public function whose named parameters are arrays.

    ``array_params`` are read (inputs), ``outputs`` are written (``out=``; a tuple value is a
    tuple of arrays). NumPy arrays go straight through; CuPy arrays run inside their device's
    context; anything else is wrapped as NumPy/CuPy over the same memory, computed on the caller's
    device and stream, and its results handed back as the caller's kind of array (``out=``
    arguments come back as the very objects passed). Names missing from the signature are ignored.
    """

    def decorate(fn):
        sig = inspect.signature(fn)
        inputs = [n for n in array_params if n in sig.parameters]
        outs = [n for n in outputs if n in sig.parameters]
        arrays = _array_arguments(sig, inputs + outs)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            bound = None
            named = arrays(args, kwargs)
            if named is None:  # not a plain call: bind resolves it or raises its TypeError
                bound = sig.bind(*args, **kwargs)
                named = bound.arguments
            flat = _flatten(named, inputs, outs)
            if all(isinstance(a, np.ndarray) for _, a in flat):
                return fn(*args, **kwargs)
            where = common_placement(flat)  # TypeError / ValueError before touching any memory
            if where.kind == CUPY:
                import cupy

                with cupy.cuda.Device(where.device):  # allocations, modules and launches on q's device
                    return fn(*args, **kwargs)
            with ForeignCall(where) as call:
                native = {name: _convert(call, name, named[name], name in outs)
                          for name in inputs + outs if named.get(name) is not None}
                if bound is None:
                    args, kwargs = arrays.substitute(args, kwargs, native)
                    return call.export(fn(*args, **kwargs))
                bound.arguments.update(native)
                return call.export(fn(*bound.args, **bound.kwargs))

        return wrapper

    return decorate
