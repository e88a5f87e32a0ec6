"""Which (B, H, N, d) views the TMA kernels take (decode_kernels.tma_ok), the byte strides their
tensor maps get (tma.bhsd_strides), and which TMA tile the dispatch picks for a shape
(plan_hopper.default_tile); no GPU needed (stand-in arrays with CuPy's attributes)."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from cuflash.plan import schedule
from cuflash.kernels import tma
from cuflash.plan.device_limits import H200
from cuflash.kernels import decode as decode_kernels
from cuflash.plan import hopper as plan_hopper


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
    assert decode_kernels.tma_ok(contiguous((2, 4, 300, 128)), contiguous((2, 2, 300, 128)))
    # an empty axis (no keys in the cache, no queries): no map can describe it
    assert not decode_kernels.tma_ok(contiguous((1, 1, 0, 64)))
    assert not decode_kernels.tma_ok(contiguous((0, 4, 300, 64)))
    # a row stride of 129 elements (258 bytes) is not a multiple of 16 bytes
    assert not decode_kernels.tma_ok(view((1, 2, 64, 128), (2 * 64 * 129, 64 * 129, 129, 1)))
    # a base 2 bytes off 16-byte alignment
    assert not decode_kernels.tma_ok(contiguous((1, 2, 64, 128), ptr=(1 << 20) + 2))
    # a head dim with stride 2 (not unit)
    assert not decode_kernels.tma_ok(view((1, 2, 64, 64), (2 * 64 * 128, 64 * 128, 128, 2)))


# --------------------------------------------------------------------------- persistent dispatch


_P64, _P64_WG3 = schedule._PERSIST_64, schedule._PERSIST_64_WG3
_P128 = schedule.HOPPER_FORWARD_PERSISTENT[128][0].tile
_LONG128 = schedule.HOPPER_FORWARD_LONG_ROWS[128].tile


@pytest.mark.parametrize(
    "d,causal,n,want",
    [
        (64, None, 1024, _P64_WG3),  # full attention: the 3-warpgroup persistent tile at any length
        (64, None, 16384, _P64_WG3),
        (64, "bottom_right", 2048, _P64),  # causal: 1024 keys per row on average, 8 key tiles
        (64, "bottom_right", 2050, _P64_WG3),  # 1025
        (64, "bottom_right", 4096, _P64_WG3),  # 2048: 16 key tiles
        (64, "bottom_right", 4098, None),  # 2049: the table's
        (128, None, 2048, _P128),  # 16 key tiles
        (128, None, 2049, None),
        (128, None, 4096, _LONG128),  # long rows: HOPPER_FORWARD_LONG_ROWS' tile
        (128, "top_left", 4096, _P128),
        (128, "top_left", 16384, _LONG128),
        (256, None, 128, None),  # no persistent rule: the O tile does not fit next to the K/V stages
        (256, "bottom_right", 4096, None),
        (192, "bottom_right", 128, None),
    ],
)
def test_default_tile_follows_the_rules(d, causal, n, want):
    t = plan_hopper.default_tile(d, causal, n, n)
    assert t == (want or schedule.HOPPER_FORWARD_TILES[d])
    assert t.tma and t.smem_bytes(d) <= H200.smem_per_block_optin
    if want is not None and want.persistent:
        rule = schedule.persistent_rule(d, causal is not None, (n * (n + 1) // 2 if causal else n * n) // n)
        assert rule is not None and rule.tile == t


@pytest.mark.parametrize("causal", [None, "bottom_right"])
@pytest.mark.parametrize("n", [2048, 4095, 4096, 8192, 16384])
def test_default_tile_follows_the_long_rows_rule(causal, n):
    # Mean visible keys per row >= min_keys: the longer key tile; just below it the table's (or,
    # for few key tiles, the persistent rule's).
    rule = schedule.HOPPER_FORWARD_LONG_ROWS[128]
    t = plan_hopper.default_tile(128, causal, n, n)
    mean = (n * (n + 1) // 2 if causal else n * n) // n
    assert (t == rule.tile) == (mean >= rule.min_keys)
    assert rule.tile.smem_bytes(128) <= H200.smem_per_block_optin


def test_persistent_tile_smem_counts_the_o_tile_and_barrier():
    t = schedule.HOPPER_FORWARD_PERSISTENT[128][0].tile
    per_tile = dataclasses.replace(t, persistent=False)
    assert t.smem_bytes(128) - per_tile.smem_bytes(128) == 128 * 128 * 2 + 8
