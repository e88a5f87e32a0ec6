"""Which (B, H, N, d) views the TMA kernels take (gpu_hopper.tma_ok) and the byte strides their
tensor maps get (tma.bhsd_strides); no GPU needed (stand-in arrays with CuPy's attributes)."""

from types import SimpleNamespace

import numpy as np
import pytest

from cuflash import gpu_hopper, tma


def view(shape, strides_elems, ptr=1 << 20, itemsize=2):
    return SimpleNamespace(shape=shape, strides=tuple(s * itemsize for s in strides_elems), itemsize=itemsize,
                           data=SimpleNamespace(ptr=ptr), dtype=np.dtype(np.float16))


def contiguous(shape, ptr=1 << 20):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.insert(0, acc)
        acc *= n
    return view(shape, strides, ptr)


def test_strides_and_nominal_strides_for_unit_axes():
    assert tma.bhsd_strides(contiguous((2, 4, 300, 128))) == [256, 300 * 256, 4 * 300 * 256]
    # extent-1 axes get a nominal 16-byte multiple (never stepped)
    assert tma.bhsd_strides(contiguous((1, 1, 300, 64))) == [128, 128, 128]


@pytest.mark.skipif(not tma.available(), reason="cuda-bindings is not installed")
def test_tma_ok_rules():
    assert gpu_hopper.tma_ok(contiguous((2, 4, 300, 128)), contiguous((2, 2, 300, 128)))
    # an empty axis (no keys in the cache, no queries): no map can describe it
    assert not gpu_hopper.tma_ok(contiguous((1, 1, 0, 64)))
    assert not gpu_hopper.tma_ok(contiguous((0, 4, 300, 64)))
    # a row stride of 129 elements (258 bytes) is not a multiple of 16 bytes
    assert not gpu_hopper.tma_ok(view((1, 2, 64, 128), (2 * 64 * 129, 64 * 129, 129, 1)))
    # a base 2 bytes off 16-byte alignment
    assert not gpu_hopper.tma_ok(contiguous((1, 2, 64, 128), ptr=(1 << 20) + 2))
    # a head dim with stride 2 (not unit)
    assert not gpu_hopper.tma_ok(view((1, 2, 64, 64), (2 * 64 * 128, 64 * 128, 128, 2)))
