"""Which (B, H, N, d) views the TMA kernels take (gpu_hopper.tma_ok), the byte strides their
tensor maps get (tma.bhsd_strides), and which TMA tile the dispatch picks for a shape
(gpu_hopper.default_tile); no GPU needed (stand-in arrays with CuPy's attributes)."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from cuflash import gpu_hopper, schedule, tma
from cuflash.device_limits import H200


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


# --------------------------------------------------------------------------- persistent dispatch


@pytest.mark.parametrize(
    "d,causal,n,persistent",
    [
        (64, None, 1024, True),  # 8 key tiles of 128 per query tile: the rule's bound
        (64, None, 1025, False),
        (64, "bottom_right", 2048, True),  # causal: 8 on average
        (64, "bottom_right", 4096, False),
        (128, None, 2048, True),  # 16 key tiles
        (128, None, 4096, False),
        (128, "top_left", 4096, True),
        (128, "top_left", 16384, False),  # long rows: HOPPER_FORWARD_LONG_ROWS' tile
        (256, None, 128, False),  # no persistent rule: the O tile does not fit next to 80-key stages
        (192, "bottom_right", 128, False),
    ],
)
def test_default_tile_follows_the_persistent_rule(d, causal, n, persistent):
    t = gpu_hopper.default_tile(d, causal, n, n)
    assert t.persistent == persistent
    if persistent:
        rule = schedule.HOPPER_FORWARD_PERSISTENT[d]
        assert t == rule.tile and t.tma and t.persistent
        assert t.smem_bytes(d) <= H200.smem_per_block_optin
    elif d in schedule.HOPPER_FORWARD_LONG_ROWS and n * (0.5 if causal else 1) >= schedule.HOPPER_FORWARD_LONG_ROWS[d].min_keys:
        assert t == schedule.HOPPER_FORWARD_LONG_ROWS[d].tile
    else:
        assert t == schedule.HOPPER_FORWARD_TILES[d]


@pytest.mark.parametrize("causal", [None, "bottom_right"])
@pytest.mark.parametrize("n", [2048, 4095, 4096, 8192, 16384])
def test_default_tile_follows_the_long_rows_rule(causal, n):
    # Mean visible keys per row >= min_keys: the longer key tile; just below it the table's (or,
    # for few key tiles, the persistent rule's).
    rule = schedule.HOPPER_FORWARD_LONG_ROWS[128]
    t = gpu_hopper.default_tile(128, causal, n, n)
    mean = (n * (n + 1) // 2 if causal else n * n) // n
    assert (t == rule.tile) == (mean >= rule.min_keys)
    assert rule.tile.smem_bytes(128) <= H200.smem_per_block_optin


def test_persistent_tile_smem_counts_the_o_tile_and_barrier():
    t = schedule.HOPPER_FORWARD_PERSISTENT[128].tile
    per_tile = dataclasses.replace(t, persistent=False)
    assert t.smem_bytes(128) - per_tile.smem_bytes(128) == 128 * 128 * 2 + 8
