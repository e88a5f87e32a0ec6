"""prepare_attention without a GPU: the NumPy path, the geometry contract, bad arguments, and the
packed parameter block's layout (cuflash.kernels.packed_launch)."""

import ctypes

import numpy as np
import pytest

import cuflash
from cuflash.kernels import packed_launch
from cuflash import fp8
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


# ----------------------------------------------------------------------------- FP8 KV caches


def _fp8_cache(rng, case, b=2, hq=4, hkv=2, nq=3, nk=40, d=16):
    """A float16 q with an e4m3 K/V cache (ml_dtypes) and float32 descales, fresh values each call:
    (args, kwargs). Cases: per-head descales with kv_lens; a paged cache (per-tensor descales, a
    cache of 8 pages every time); no descales; "bshd" with a per-tensor k_descale alone."""
    layout_bshd = case == "bshd"
    q = rng.standard_normal((b, nq, hq, d) if layout_bshd else (b, hq, nq, d)).astype(FLOAT16)
    kv_shape = (b, nk, hkv, d) if layout_bshd else (b, hkv, nk, d)
    k, v = (fp8.to_e4m3(rng.standard_normal(kv_shape) * 20) for _ in "kv")
    lens = np.array([int(rng.integers(1, nk + 1)), 0], dtype=np.int32)
    per_head = [rng.uniform(0.01, 0.1, (b, hkv)).astype(np.float32) for _ in "kv"]
    per_tensor = [np.array(rng.uniform(0.01, 0.1), dtype=np.float32) for _ in "kv"]
    if case == "per-head-lens":
        return (q, k, v), dict(kv_lens=lens, k_descale=per_head[0], v_descale=per_head[1])
    if case == "paged":
        used = sum(-(-int(n) // 16) for n in lens)
        kc, vc, table = paged_cache(rng, k.astype(np.float32), v.astype(np.float32), lens, 16, spare=8 - used)
        kc, vc = (fp8.to_e4m3(c) for c in (kc, vc))  # (unused pages hold e4m3 NaN)
        return (q, kc, vc), dict(kv_lens=lens, block_table=table, k_descale=per_tensor[0], v_descale=per_tensor[1])
    if case == "unscaled":
        return (q, k, v), {}
    return (q, k, v), dict(k_descale=per_tensor[0])


@pytest.mark.parametrize("case", ["per-head-lens", "paged", "unscaled", "bshd"])
def test_prepared_numpy_fp8_cache_equals_attention(case):
    # NumPy: the "attention" path; each call (fresh data and descale values, one geometry) equals
    # cuflash.attention on the same arrays bit for bit, the inputs untouched.
    rng = np.random.default_rng([len(case), 3])
    opts = dict(causal="bottom_right", return_lse=True, layout="bshd" if case == "bshd" else "bhsd")
    if case == "bshd":
        opts["window"] = (7, 0)
    args, kw = _fp8_cache(rng, case)
    run = cuflash.prepare_attention(*args, **opts, **kw)
    assert run.path == "attention" and run.kernel is None
    results = []
    for _ in range(2):
        args, kw = _fp8_cache(rng, case)
        before = [a.copy() for a in (*args, *kw.values())]
        out = np.full(args[0].shape, np.nan, dtype=FLOAT16)
        o, lse = run(*args, out=out, **kw)
        assert o is out
        want_o, want_lse = cuflash.attention(*args, **opts, **kw)
        np.testing.assert_array_equal(o.view(np.uint16), want_o.view(np.uint16))
        np.testing.assert_array_equal(lse, want_lse)
        for a, a0 in zip((*args, *kw.values()), before):
            np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), a0.reshape(-1).view(np.uint8))
        results.append(o.copy())
    assert not np.array_equal(results[0].view(np.uint16), results[1].view(np.uint16))  # (the calls' own data)


def test_prepared_fp8_cache_reads_each_calls_descales():
    # Same cache, other descale values: the result follows them as attention's does (v's descale
    # scales o), so a prepared call does not keep the example's values.
    rng = np.random.default_rng(13)
    (q, k, v), kw = _fp8_cache(rng, "per-head-lens")
    run = cuflash.prepare_attention(q, k, v, **kw)
    o1 = run(q, k, v, **kw)
    doubled = dict(kw, v_descale=kw["v_descale"] * np.float32(2))
    o2 = run(q, k, v, **doubled)
    np.testing.assert_array_equal(o2.view(np.uint16), cuflash.attention(q, k, v, **doubled).view(np.uint16))
    np.testing.assert_array_equal(o2[0].astype(np.float32), (2 * o1[0].astype(np.float32)).astype(FLOAT16))
    assert np.abs(o1[0]).max() > 0


def test_prepared_fp8_cache_geometry_contract():
    # The descales' geometry is fixed at preparation (shape, strides, dtype, kind, given or not);
    # a call that differs raises ValueError naming the descale.
    rng = np.random.default_rng(17)
    (q, k, v), kw = _fp8_cache(rng, "per-head-lens")
    run = cuflash.prepare_attention(q, k, v, **kw)
    lens, kd, vd = kw["kv_lens"], kw["k_descale"], kw["v_descale"]
    with pytest.raises(ValueError, match=r"^k_descale: prepared for numpy shape \(2, 2\) .*, got numpy shape \(\)"):
        run(q, k, v, kv_lens=lens, k_descale=np.ones((), np.float32), v_descale=vd)
    with pytest.raises(ValueError, match=r"^v_descale: prepared for numpy shape \(2, 2\) .*, got not given"):
        run(q, k, v, kv_lens=lens, k_descale=kd)
    with pytest.raises(ValueError, match="^k_descale: prepared for .* float32, got .* float64"):
        run(q, k, v, kv_lens=lens, k_descale=kd.astype(np.float64), v_descale=vd)
    with pytest.raises(ValueError, match=r"^v_descale: prepared for .*strides \(8, 4\).*, got .*strides \(4, 8\)"):
        run(q, k, v, kv_lens=lens, k_descale=kd, v_descale=np.asfortranarray(vd))  # same shape, other strides
    with pytest.raises(ValueError, match="^k: prepared for numpy .*float8_e4m3fn, got .*float16"):
        run(q, k.astype(np.float32).astype(FLOAT16), v, **kw)
    with pytest.raises(ValueError, match="^k_descale: prepared for numpy .*, got list"):
        run(q, k, v, kv_lens=lens, k_descale=kd.tolist(), v_descale=vd)
    unscaled = cuflash.prepare_attention(q, k, v, kv_lens=lens)
    with pytest.raises(ValueError, match="^k_descale: prepared for not given, got numpy shape"):
        unscaled(q, k, v, kv_lens=lens, k_descale=kd)
    plain = cuflash.prepare_attention(*_inputs(rng))
    with pytest.raises(ValueError, match="^v_descale: prepared for not given"):
        plain(*_inputs(rng), v_descale=vd)
    # Values may change, and so does attention's check of them on the NumPy backend.
    bad = kd.copy()
    bad[1, 0] = np.inf
    with pytest.raises(ValueError, match="^k_descale: has NaN or infinite values"):
        run(q, k, v, kv_lens=lens, k_descale=bad, v_descale=vd)


def _same_error(exc_type, prepare, attention):
    """prepare() and attention() raise the same error (type and message)."""
    with pytest.raises(exc_type) as prepared_error:
        prepare()
    with pytest.raises(exc_type) as attention_error:
        attention()
    assert str(prepared_error.value) == str(attention_error.value)
    return str(prepared_error.value)


def test_prepare_checks_an_fp8_cache_like_attention():
    rng = np.random.default_rng(19)
    (q, k, v), kw = _fp8_cache(rng, "per-head-lens")
    (qp, kc, vc), kwp = _fp8_cache(rng, "paged")

    def both(exc_type, args, **kwargs):
        return _same_error(exc_type, lambda: cuflash.prepare_attention(*args, **kwargs),
                           lambda: cuflash.attention(*args, **kwargs))

    assert both(TypeError, (q, k, v.astype(np.float32).astype(FLOAT16)), **kw).startswith("v: expected float8_e4m3fn")
    assert both(ValueError, (q, k, v), **dict(kw, k_descale=np.ones((2, 4), np.float32))).startswith(
        "k_descale: expected shape () or (2, 2)")
    assert both(TypeError, (q, k, v), **dict(kw, v_descale=np.ones((), np.float64))).startswith(
        "v_descale: expected dtype float32")
    assert both(ValueError, (q, k, v), **dict(kw, v_descale=np.full((2, 2), np.nan, np.float32))).startswith(
        "v_descale: has NaN")
    assert both(ValueError, (qp, kc, vc), **dict(kwp, k_descale=np.ones((2, 2), np.float32))).startswith(
        "k_descale: expected shape ()")  # (a paged cache: one factor per tensor)
    assert both(ValueError, (q, k, v), **dict(kw, kv_lens=np.array([0, 41], np.int32))).startswith(
        "kv_lens: values must lie")
    assert both(TypeError, (q, k, v.astype(np.float32).astype(FLOAT16)),
                k_descale=kw["k_descale"]).startswith("v: expected float8_e4m3fn")
    assert both(TypeError, (q, k.astype(np.float32).astype(FLOAT16), v.astype(np.float32).astype(FLOAT16)),
                k_descale=kw["k_descale"]).startswith("q: expected float8_e4m3fn (a descale factor was given)")
    # An e4m3 q is attention's, not a prepared call's.
    q8 = fp8.to_e4m3(q.astype(np.float32))
    with pytest.raises(NotImplementedError, match="^q: prepare_attention takes FP8 inputs as an FP8 KV cache only"):
        cuflash.prepare_attention(q8, k, v, **kw)
    cuflash.attention(q8, k, v, **kw)  # (which attention runs)


def test_prepared_torch_cpu_fp8_cache():
    # torch CPU float8_e4m3fn tensors: the NumPy backend through the same adapter as attention.
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without float8_e4m3fn")
    rng = np.random.default_rng(23)

    def tensors():
        (q, k, v), kw = _fp8_cache(rng, "per-head-lens")
        return ([torch.from_numpy(q.view(np.int16)).view(torch.float16)]
                + [torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn) for a in (k, v)],
                {n: torch.from_numpy(a) for n, a in kw.items()})

    args, kw = tensors()
    run = cuflash.prepare_attention(*args, causal=True, **kw)
    assert run.path == "attention"
    args, kw = tensors()
    o = run(*args, **kw)
    want = cuflash.attention(*args, causal=True, **kw)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.float16
    assert torch.equal(o.view(torch.int16), want.view(torch.int16))
    with pytest.raises(ValueError, match="^k: prepared for torch"):
        run(args[0], args[1].view(torch.uint8), args[2], **kw)


def test_call_launch_of_an_e4m3_cache(monkeypatch):
    # kernels.decode.call_launch, which attention's decode calls and prepared calls both plan
    # through: an e4m3 cache's strides in 16-bit words, its own tile, and its descales as the split
    # kernel's last four parameters (the prepared launch fills them as pointer slots), for a
    # contiguous and a paged cache and the cluster merge.
    from cuflash.core.problem import validate_forward, validate_paged
    from cuflash.kernels import decode as decode_kernels
    from cuflash.kernels import device
    from cuflash.plan import schedule

    monkeypatch.setattr(device, "sm_count", lambda dev: 132)
    monkeypatch.setattr(device, "compute_capability", lambda dev: 90)
    b, hq, hkv, nq, nk, d = 2, 8, 2, 1, 4096, 128
    q4 = np.empty((b, hq, nq, d), BFLOAT16)
    k4 = np.empty((b, hkv, nk, d), np.uint8)
    stand = np.empty((b, hkv, nk, d), BFLOAT16)
    p = validate_forward(q4, stand, stand)
    dl = decode_kernels.call_launch(p, 0, q4, k4, k4, q4, kv8=True)
    words, elems = tuple(s // 2 for s in k4.strides), tuple(s // 2 for s in q4.strides)  # (k4 bytes, q4 bf16)
    tile8 = schedule.DECODE_TILES_KV8[schedule.head_dim_bucket(d)]
    want = decode_kernels.decode_launch(p, 0, (elems, words, words, elems, 0), None, tile=tile8)
    assert dl == want and dl.plan.tile.kv_bytes == 1
    assert decode_kernels.call_launch(p, 0, q4, stand, stand, q4).plan.tile.kv_bytes == 2  # (16-bit: its own)
    marks = tuple(f"a{i}" for i in range(10))
    args = dl.main_args(*marks, kv_descales=("kd", "vd", 2, 1))
    assert args[-4:] == ("kd", "vd", np.int64(2), np.int64(1)) and type(args[-2]) is np.int64
    assert dl.main_args(*marks) == args[:-4]
    cluster = decode_kernels.call_launch(p, 0, q4, k4, k4, q4, kv8=True, cluster=True)
    assert cluster.plan.cluster and cluster.main_args(*marks, kv_descales=("kd", "vd", 0, 0))[-4:-2] == ("kd", "vd")
    # A paged cache: the table's row stride and the page shift.
    kc = np.empty((20, 64, hkv, d), np.uint8)
    table = np.zeros((b, nk // 64), np.int32)
    pp, bs = validate_paged(q4, *(np.empty(kc.shape, BFLOAT16) for _ in "kv"), table)
    paged = decode_kernels.call_launch(pp, 0, q4, kc, kc, q4, (table, bs), kv8=True)
    page_words = tuple(s // 2 for s in kc.strides)
    assert paged == decode_kernels.decode_launch(pp, 0, (elems, page_words, page_words, elems, nk // 64), 6,
                                                 tile=tile8)
