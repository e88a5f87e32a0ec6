"""prepare_attention without a GPU: the NumPy path, the geometry contract, bad arguments, and the
packed parameter block's layout (cuflash.kernels.packed_launch)."""

import ctypes

import numpy as np
import pytest

import cuflash
from cuflash.kernels import packed_launch
from cuflash.core.arrays import BFLOAT16, FLOAT16
from cuflash.testing import random_inputs

from test_paged import paged_cache


def _inputs(rng, b=2, hq=4, hkv=2, nq=3, nk=40, d=16, dtype=FLOAT16):
    return random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), dtype)


@pytest.mark.parametrize("case", ["plain", "lens", "paged", "window-bshd"])
def test_prepared_numpy_equals_attention(case):
    # Prepared on one set of arrays, called on fresh ones of the same geometry: every result equals
    # cuflash.attention's on the same arrays, and the inputs are left as they were.
    rng = np.random.default_rng(len(case))
    opts = dict(causal="bottom_right", return_lse=True)

    def make():
        q, k, v = _inputs(rng)
        lens = np.array([0, int(rng.integers(1, 40))], dtype=np.int32)
        if case == "plain":
            return (q, k, v), {}
        if case == "lens":
            return (q, k, v), dict(kv_lens=lens)
        if case == "paged":
            used = sum(-(-int(n) // 16) for n in lens)
            kc, vc, table = paged_cache(rng, k, v, lens, 16, spare=8 - used)  # a cache of 8 pages every time
            return (q, kc, vc), dict(kv_lens=lens, block_table=table)
        return tuple(np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in (q, k, v)), {}

    if case == "window-bshd":
        opts.update(layout="bshd", window=(5, 0))
    args, kw = make()
    run = cuflash.prepare_attention(*args, **opts, **kw)
    assert run.path == "attention"  # NumPy: cuflash.attention per call
    for _ in range(2):
        args, kw = make()
        before = [a.copy() for a in (*args, *kw.values())]
        o, lse = run(*args, **kw)
        want_o, want_lse = cuflash.attention(*args, **opts, **kw)
        np.testing.assert_array_equal(o.view(np.uint16), want_o.view(np.uint16))
        np.testing.assert_array_equal(lse, want_lse)
        for a, a0 in zip((*args, *kw.values()), before):
            np.testing.assert_array_equal(a.view(np.uint8), a0.view(np.uint8))


def test_prepared_geometry_contract():
    rng = np.random.default_rng(1)
    q, k, v = _inputs(rng)
    lens = np.array([3, 40], dtype=np.int32)
    run = cuflash.prepare_attention(q, k, v, kv_lens=lens)
    q2, k2, v2 = _inputs(rng, b=3)
    with pytest.raises(ValueError, match=r"^q: prepared for numpy shape \(2, 4, 3, 16\)"):
        run(q2, k, v, kv_lens=lens)
    with pytest.raises(ValueError, match="^k: prepared for"):
        run(q, k.astype(BFLOAT16), v, kv_lens=lens)
    with pytest.raises(ValueError, match="^v: prepared for"):
        run(q, k, np.asfortranarray(v), kv_lens=lens)  # same shape and dtype, other strides
    with pytest.raises(ValueError, match="^kv_lens: prepared for .*, got not given"):
        run(q, k, v)
    with pytest.raises(ValueError, match="^block_table: prepared for not given"):
        run(q, k, v, kv_lens=lens, block_table=np.zeros((2, 3), np.int32))
    bad = np.array([3, 41], dtype=np.int32)
    with pytest.raises(ValueError, match="kv_lens: values must lie"):
        run(q, k, v, kv_lens=bad)  # validate=True (default) checks each call's values
    with pytest.raises(TypeError):
        run(q, k, v, kv_lens=lens, causal=True)  # options are fixed at prepare time
    with pytest.raises(ValueError, match=r"^q: prepared for numpy .*, got list"):
        run(q.tolist(), k, v, kv_lens=lens)


def test_prepare_checks_arguments_like_attention():
    rng = np.random.default_rng(2)
    q, k, v = _inputs(rng)
    with pytest.raises(TypeError, match="^k: dtype float64 is not supported"):
        cuflash.prepare_attention(q, k.astype(np.float64), v)
    with pytest.raises(ValueError, match="window"):
        cuflash.prepare_attention(q, k, v, window=(-2, 0))
    with pytest.raises(ValueError, match="kv_lens: values must lie"):
        cuflash.prepare_attention(q, k, v, kv_lens=np.array([0, 41], np.int32))
    with pytest.raises(TypeError, match="validate"):
        cuflash.prepare_attention(q, k, v, validate="yes")
    with pytest.raises(TypeError, match="^v: is a CuPy array|^v: expected an array"):
        cuflash.prepare_attention(q, k, [1, 2])


def test_slot_values_are_the_parameter_bytes():
    # Each kernel parameter sits in its own 8-byte slot, low bytes first (little-endian), as the
    # driver reads sizeof(parameter) bytes from the slot's address.
    assert packed_launch._slot_value(np.int32(-1)) == 0xFFFFFFFF
    assert packed_launch._slot_value(np.int32(7)) == 7
    assert packed_launch._slot_value(np.int64(-2)) == 2**64 - 2
    assert packed_launch._slot_value(np.uint64(2**63 + 5)) == 2**63 + 5
    assert packed_launch._slot_value(np.float32(1.0)) == 0x3F800000
    with pytest.raises(TypeError, match="scalar arguments"):
        packed_launch._slot_value(5)  # a Python int has no fixed width
    with pytest.raises(TypeError, match="scalar arguments"):
        packed_launch._slot_value(np.complex128(1))


def test_launch_structures_match_cuda_h():
    # CUlaunchAttribute: 4-byte id, 4 bytes of padding, 64-byte union; CUlaunchConfig: seven
    # unsigned ints, then the stream, attrs and numAttrs at 8-byte-aligned offsets (cuda.h).
    assert ctypes.sizeof(packed_launch._LaunchAttribute) == 72 and packed_launch._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(packed_launch._LaunchConfig) == 56
    assert (packed_launch._LaunchConfig.shared_mem.offset, packed_launch._LaunchConfig.stream.offset,
            packed_launch._LaunchConfig.attrs.offset, packed_launch._LaunchConfig.num_attrs.offset) == (24, 32, 40, 48)


def test_packed_launch_is_one_call_per_thread(monkeypatch):
    # ctypes releases the GIL inside the driver call, and the driver copies the parameters only
    # there: two threads sharing one PackedLaunch (a prepared call, the plan cache of
    # cuflash.attention) must each launch with their own addresses. A stand-in driver sleeps
    # (letting the other threads run) before it reads the parameter block, as a slow launch would.
    import threading
    import time
    from types import SimpleNamespace

    seen = []

    def fake_launch(function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        time.sleep(0.0002)
        slots = (ctypes.c_void_p * 3).from_address(params)
        seen.append((stream, tuple(ctypes.c_uint64.from_address(slots[i]).value for i in (0, 2))))
        return 0

    monkeypatch.setattr(packed_launch, "_driver", lambda: (fake_launch, None, None))
    fn = SimpleNamespace(name="k", kernel=SimpleNamespace(ptr=1))
    packed = packed_launch.PackedLaunch(fn, (1,), (32,), (packed_launch.POINTER, np.int32(5), packed_launch.POINTER), 0)

    def worker(t):
        for i in range(40):
            packed.launch(t, 1000 * t + i, 1000 * t + i + 500)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(1, 5)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(seen) == 160
    wrong = [(s, ptrs) for s, ptrs in seen if ptrs[0] // 1000 != s or ptrs[1] != ptrs[0] + 500]
    assert not wrong, f"{len(wrong)} launches read another thread's addresses, e.g. {wrong[:3]}"
