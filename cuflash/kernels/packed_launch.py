"""A kernel launch whose arguments are packed once: per call only the array pointers change.

CuPy's ``RawKernel.__call__`` converts every argument on every launch (about 20 us for the
decode kernel's 35 arguments on the H200 machine's host, tools/decode_host_parts.py). A repeated
call with one geometry (a decoding loop, ``cuflash.prepare_attention``) needs none of that: the
scalars never change, so they are written once into a parameter block and the launch is one
``cuLaunchKernel`` through ctypes with the pointers of this call's arrays written into their
slots. Each parameter gets its own 8-byte slot (the driver copies each parameter's own size from
its slot, so 4-byte scalars sit in the low bytes: little-endian hosts only, as CUDA's are).

The kernel's own attributes (dynamic shared memory opt-in, cluster dimensions compiled in with
``__cluster_dims__``) are the function's, set once by kernels.build.get_function, so the plain launch is
the same launch CuPy makes.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading

import numpy as np

POINTER = None  # a slot filled per call with an array's device address


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint64 * 8)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)


@functools.lru_cache(maxsize=None)
def _driver():
    """libcuda's cuLaunchKernel, cuLaunchKernelEx and cuGetErrorName (the library CuPy already loaded)."""
    lib = ctypes.CDLL("libcuda.so.1" if sys.platform != "win32" else "nvcuda.dll")
    launch = lib.cuLaunchKernel
    launch.restype = ctypes.c_int
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    launch_ex = lib.cuLaunchKernelEx
    launch_ex.restype = ctypes.c_int
    launch_ex.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    name = lib.cuGetErrorName
    name.restype = ctypes.c_int
    name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return launch, launch_ex, name


def _slot_value(arg) -> int:
    """The 8-byte slot (as a uint64) holding one scalar argument's bytes."""
    if not isinstance(arg, np.generic) or arg.dtype.itemsize > 8 or arg.dtype.kind not in "iuf":
        raise TypeError(f"packed launch: scalar arguments must be NumPy ints or floats of <= 8 bytes, "
                        f"got {type(arg).__name__}")
    raw = np.zeros(8, dtype=np.uint8)
    raw[: arg.dtype.itemsize] = np.frombuffer(arg.tobytes(), dtype=np.uint8)
    return int(raw.view(np.uint64)[0])


class PackedLaunch:
    """``fn(grid, block, args, shared_mem=smem)`` with the scalars of ``args`` packed now and
    every ``POINTER`` entry (in order) filled from ``launch(stream, *pointers)``.

    ``programmatic``: launch as a programmatic dependent of the kernel before it on the stream
    (cuLaunchKernelEx with programmatic stream serialization, as cuflash.kernels.pdl does through
    cuda-bindings); the kernel must wait (griddepcontrol.wait) before reading that kernel's
    results."""

    def __init__(self, fn, grid, block, args, shared_mem: int, programmatic: bool = False):
        self.name = getattr(fn, "name", "kernel")
        self._function = int(fn.kernel.ptr)
        grid = tuple(int(x) for x in grid) + (1,) * (3 - len(grid))
        block = tuple(int(x) for x in block) + (1,) * (3 - len(block))
        self._dims = grid + block + (int(shared_mem),)
        n = max(len(args), 1)
        self._slots = (ctypes.c_uint64 * n)()
        self._pointer_slots = []
        for i, a in enumerate(args):
            if a is POINTER:
                self._pointer_slots.append(i)
            else:
                self._slots[i] = _slot_value(a)
        base = ctypes.addressof(self._slots)
        self._params = (ctypes.c_void_p * n)(*[base + 8 * i for i in range(n)])
        self._params_address = ctypes.addressof(self._params)
        self._config = None
        # One parameter block per launch object, rewritten per call: a lock keeps two threads'
        # calls from interleaving (ctypes releases the GIL during the driver call, and the
        # driver copies the parameters only inside it), which would launch one thread's kernel
        # with the other's addresses. Uncontended, it costs well under a microsecond.
        self._lock = threading.Lock()
        if programmatic:
            self._attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
            self._attr.value[0] = 1  # programmaticStreamSerializationAllowed (an int at the union's start)
            self._config = _LaunchConfig(grid=(ctypes.c_uint * 3)(*grid), block=(ctypes.c_uint * 3)(*block),
                                         shared_mem=int(shared_mem), stream=None,
                                         attrs=ctypes.pointer(self._attr), num_attrs=1)
            self._config_ref = ctypes.byref(self._config)

    def launch(self, stream: int, *pointers: int) -> None:
        """Launch on ``stream`` (a CUstream address, 0 for the legacy default stream) with the
        array arguments' device addresses in the order of the ``POINTER`` entries."""
        if len(pointers) != len(self._pointer_slots):
            raise TypeError(f"{self.name}: {len(self._pointer_slots)} array addresses expected, got {len(pointers)}")
        slots = self._slots
        launch, launch_ex, _ = _driver()
        with self._lock:
            for i, ptr in zip(self._pointer_slots, pointers):
                slots[i] = ptr
            if self._config is None:
                err = launch(self._function, *self._dims, stream, self._params_address, None)
            else:
                self._config.stream = stream
                err = launch_ex(self._config_ref, self._function, self._params_address, None)
        if err:
            self._raise(err)

    def _raise(self, err):
        *_, name = _driver()
        text = ctypes.c_char_p()
        name(err, ctypes.byref(text))
        raise RuntimeError(f"{'cuLaunchKernelEx' if self._config is not None else 'cuLaunchKernel'} failed for "
                           f"{self.name}: {(text.value or b'?').decode()} ({err})")
