"""Zeroed 4-byte counters for kernels in which the last block of a group merges the group's
partial results (split-KV decode's last split, the forward's key split): each block counts itself
in with an atomic, and the block that completes the count merges and sets the counter back to zero.

So every launch leaves its counters zero, and launches on one stream - which run in order - can
share one buffer: it is kept per (device, stream), allocated once (cudaMalloc, never freed: a
launch queued on the stream may still count in a buffer that a larger one replaced) and zeroed on
that stream, and no call pays a memset. Under CUDA graph capture that sharing is not safe - a
replay may run on another stream next to direct calls on the captured one - so a captured call
passes `fresh`, a buffer of its own that the graph owns (allocated as its other per-call buffers
are), and a memset node zeroes it on every replay.
"""

from __future__ import annotations

from ..core.problem import stream_is_capturing

import threading

_buffers: dict = {}  # (device, stream handle) -> (address, counters)
_lock = threading.Lock()
MIN_COUNTERS = 1024  # a first buffer's size (4 KiB), so that a few geometries share it


def zeroed(n: int, stream: int, fresh: int | None = None) -> int:
    """The device address of n counters that are zero when the next launch on `stream` (a
    cudaStream_t address) starts; `fresh`: under capture, the address of the call's own buffer of
    at least 4 n bytes (zeroed here by a memset on the stream)."""
    import cupy

    rt = cupy.cuda.runtime
    if fresh is not None:
        rt.memsetAsync(fresh, 0, 4 * n, stream)
        return fresh
    key = (rt.getDevice(), stream)
    entry = _buffers.get(key)
    if entry is None or entry[1] < n:
        with _lock:
            entry = _buffers.get(key)
            if entry is None or entry[1] < n:
                size = max(n, MIN_COUNTERS)
                address = rt.malloc(4 * size)
                rt.memsetAsync(address, 0, 4 * size, stream)
                entry = _buffers[key] = (address, size)
    return entry[0]


def for_cupy_launch(n: int, dtype="int32"):
    """(address, holder) of n zeroed counters for a launch on CuPy's current stream: the stream's
    shared buffer, or under capture a fresh CuPy array (`holder`: keep it until the launch is
    queued; None otherwise)."""
    import cupy

    stream = cupy.cuda.get_current_stream().ptr
    if not stream_is_capturing():
        return zeroed(n, stream), None
    holder = cupy.empty((n,), dtype=dtype)
    return zeroed(n, stream, holder.data.ptr), holder


def view(n: int, stream: int):
    """The first n counters of `stream`'s buffer on the current device as a CuPy int32 array
    (for tests: after a launch they must be zero again)."""
    import cupy
    import numpy as np

    address = zeroed(n, stream)
    mem = cupy.cuda.UnownedMemory(address, 4 * n, None)
    return cupy.ndarray((n,), dtype=np.int32, memptr=cupy.cuda.MemoryPointer(mem, 0))
