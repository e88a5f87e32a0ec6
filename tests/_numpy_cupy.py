"""A stand-in for the parts of CuPy that cuflash's decode paths touch, over NumPy memory: arrays
with CuPy's module name, ``.data.ptr`` / ``.data.mem`` and 256-byte aligned allocations, so that
the host side of a GPU call (validation, planning, views, the launch arguments) runs without a
GPU while the launches themselves are stubbed (tests/test_prepared_launches.py). Nothing reads or
writes the arrays' values but the host checks (kv_lens, block_table)."""
import sys
import types

import numpy as np

_ALIGN = 256


class _Mem:
    pass


class ndarray:
    def __init__(self, shape, dtype=np.float32, memptr=None):  # (cupy.ndarray(shape, dtype, memptr=))
        a = _aligned_empty(shape, dtype)
        self._a, self._mem = a, (_Mem() if memptr is None else memptr.mem)

    @classmethod
    def _wrap(cls, a, mem=None):
        self = cls.__new__(cls)
        self._a, self._mem = a, (mem if mem is not None else _Mem())
        return self

    # attributes
    shape = property(lambda s: s._a.shape)
    strides = property(lambda s: s._a.strides)
    dtype = property(lambda s: s._a.dtype)
    ndim = property(lambda s: s._a.ndim)
    size = property(lambda s: s._a.size)
    itemsize = property(lambda s: s._a.itemsize)
    flags = property(lambda s: types.SimpleNamespace(c_contiguous=s._a.flags.c_contiguous))
    device = property(lambda s: types.SimpleNamespace(id=0))

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self._a.__array_interface__["data"][0], mem=self._mem, device_id=0)

    def _view(self, a):
        if a.size and not np.shares_memory(a, self._a):
            return ndarray._wrap(a)
        return ndarray._wrap(a, self._mem)

    def reshape(self, *shape):
        return self._view(self._a.reshape(*shape))

    def transpose(self, *axes):
        return self._view(self._a.transpose(*axes))

    def view(self, dtype):
        return self._view(self._a.view(dtype))

    def __getitem__(self, i):
        return self._view(self._a[i])

    def __setitem__(self, i, v):
        self._a[i] = v._a if isinstance(v, ndarray) else v

    def copy(self):
        return ndarray._wrap(_copy(self._a))

    def astype(self, dtype):
        return ndarray._wrap(_copy(self._a.astype(dtype)))

    def fill(self, v):
        self._a.fill(v)

    def get(self):
        return self._a.copy()

    def __mul__(self, x):
        return ndarray._wrap(_copy(self._a * x))

    def __add__(self, x):
        return ndarray._wrap(_copy(self._a + x))


ndarray.__module__ = "cupy._core.core"


def _aligned_empty(shape, dtype):
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(n + _ALIGN, np.uint8)
    off = (-raw.__array_interface__["data"][0]) % _ALIGN
    return raw[off:off + n].view(dtype).reshape(shape)


def _copy(a):
    c = _aligned_empty(a.shape, a.dtype)
    c[...] = a
    return c


def empty(shape, dtype=np.float32):
    return ndarray._wrap(_aligned_empty(shape if isinstance(shape, tuple) else (shape,), dtype))


def zeros(shape, dtype=np.float32):
    a = empty(shape, dtype)
    a._a[...] = 0
    return a


def full(shape, value, dtype=np.float32):
    a = empty(shape, dtype)
    a._a[...] = value
    return a


def asarray(x):
    if isinstance(x, ndarray):
        return x
    return ndarray._wrap(_copy(np.asarray(x)))


def ascontiguousarray(a):
    if a._a.flags.c_contiguous:
        return a
    return ndarray._wrap(_copy(a._a))


def asfortranarray(a):
    f = np.asfortranarray(a._a)
    c = _aligned_empty(f.shape[::-1], f.dtype).T
    c[...] = f
    return ndarray._wrap(c)


def broadcast_to(a, shape):
    return ndarray._wrap(np.broadcast_to(a._a, shape), a._mem)


def _as_strided(a, shape, strides):
    return ndarray._wrap(np.lib.stride_tricks.as_strided(a._a, shape, strides), a._mem)


lib = types.SimpleNamespace(stride_tricks=types.SimpleNamespace(as_strided=_as_strided))


class _Device:
    def __init__(self, n=None):
        self.id = 0

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class _Stream:
    ptr = 0

    def is_capturing(self):
        return False


cuda = types.SimpleNamespace(Device=_Device, get_current_stream=lambda: _Stream(),
                             runtime=types.SimpleNamespace(getDevice=lambda: 0))


def install(monkeypatch):
    """sys.modules["cupy"] = this stand-in for the test (monkeypatch restores it)."""
    mod = types.ModuleType("cupy")
    for name in ("ndarray", "empty", "zeros", "full", "asarray", "ascontiguousarray", "asfortranarray",
                 "broadcast_to", "lib", "cuda"):
        setattr(mod, name, globals()[name])
    monkeypatch.setitem(sys.modules, "cupy", mod)
    return mod
