"""CUDA graph capture, checked without a GPU through a stand-in CuPy whose current stream
reports a capture: host reads of device arrays raise a ValueError naming the argument (CUDA
would only invalidate the capture), and capturing without a graph-owned allocator warns."""

from __future__ import annotations

import sys
import types
import warnings

import numpy as np
import pytest

from cuflash.core import problem


class _DeviceArray:
    """What to_host needs of a CuPy array: .get()."""

    def __init__(self, values):
        self.values = np.asarray(values)
        self.copies = 0

    def get(self):
        self.copies += 1
        return self.values


def _fake_cupy(monkeypatch, capturing, allocator=None):
    class MemoryAsyncPool:
        def malloc(self, n):
            return n

    stream = types.SimpleNamespace(is_capturing=lambda: capturing)
    cuda = types.SimpleNamespace(get_current_stream=lambda: stream, MemoryAsyncPool=MemoryAsyncPool,
                                 get_allocator=lambda: allocator(MemoryAsyncPool) if allocator else (lambda n: n))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))


def test_host_read_outside_a_capture_copies(monkeypatch):
    _fake_cupy(monkeypatch, capturing=False)
    a = _DeviceArray([3, 4])
    assert np.array_equal(problem.to_host(a, "kv_lens", "why"), [3, 4]) and a.copies == 1
    plain = np.arange(3)
    assert problem.to_host(plain, "kv_lens", "why") is plain


def test_host_read_inside_a_capture_names_the_argument(monkeypatch):
    _fake_cupy(monkeypatch, capturing=True)
    a = _DeviceArray([3, 4])
    with pytest.raises(ValueError, match=r"^block_table: validate=True checks .*captured into a CUDA graph"):
        problem.check_block_table(a, np.array([3, 4]), 16, 10)
    assert a.copies == 0  # no copy was attempted
    assert problem.stream_is_capturing()


def test_capture_warns_unless_the_allocator_is_the_async_pool(monkeypatch):
    _fake_cupy(monkeypatch, capturing=True)
    with pytest.warns(RuntimeWarning, match="MemoryAsyncPool"):
        problem.warn_if_capture_unsafe(stacklevel=2)
    _fake_cupy(monkeypatch, capturing=True, allocator=lambda cls: cls().malloc)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        problem.warn_if_capture_unsafe()
    _fake_cupy(monkeypatch, capturing=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        problem.warn_if_capture_unsafe()


def test_no_cupy_is_not_capturing(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    assert not problem.stream_is_capturing()
