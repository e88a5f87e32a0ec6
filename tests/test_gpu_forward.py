"""CUDA forward vs the float64 reference, by the naive-error rule (cuflash.testing).

Every launch writes into NaN-poisoned o and lse, so an element the kernel forgets shows up, and
the inputs are compared bit for bit afterwards. The reference is float64 from the same
low-precision inputs; the bound is twice the error of the naive formula evaluated in the input
dtype plus one rounding. For long sequences only windows of query rows are checked: the float64
reference and the naive yardstick on the CPU are the slow part, and a window of rows [r0, r1) is
an exact smaller problem (keys past the window's last visible key dropped, the causal diagonal
re-aligned), so the same helpers judge it.

Also: bitwise repeatability, rows that see no key, no device allocation beyond lse, 64-bit
offsets, CuPy's current stream, the grid's batch limit.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash.core import problem as _problem
from cuflash.plan import schedule
from cuflash.core.arrays import BFLOAT16, FLOAT16, FLOAT32
from cuflash.core.layout import is_view_of, to_bhsd
from cuflash.testing import assert_forward_accurate, causal_mode, random_array, random_inputs, recorded_allocations
from cuflash.backends import cuda
from cuflash.kernels import forward as forward_kernels
from cuflash.plan import hopper as plan_hopper

from _launches import record_launches

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

DTYPES = [pytest.param(FLOAT16, id="f16"), pytest.param(BFLOAT16, id="bf16"), pytest.param(FLOAT32, id="f32")]
CAUSAL = [pytest.param(False, id="full"), pytest.param("bottom_right", id="br"), pytest.param("top_left", id="tl")]

# Raw bits: CuPy's bfloat16 support is storage-level, so copies, fills and comparisons go through
# same-size unsigned views.
_UINT = {2: np.uint16, 4: np.uint32}
_NAN_BITS = {FLOAT16: 0x7E00, BFLOAT16: 0x7FC0, FLOAT32: 0x7FC00000}
_WINDOW = 48  # query rows per checked window of a long sequence
_FULL_CHECK_ROWS = 512  # up to this many query rows, every row is checked


# ----------------------------------------------------------------------------- helpers

def raw(a):
    return a.view(_UINT[a.dtype.itemsize])


def to_device(a):
    a = np.ascontiguousarray(a)
    return cupy.asarray(a.view(_UINT[a.dtype.itemsize])).view(a.dtype)


def to_host(a):
    return raw(cupy.ascontiguousarray(a)).get().view(a.dtype)


def poisoned(shape, dtype):
    dtype = np.dtype(dtype)
    a = cupy.empty(shape, dtype=dtype)
    raw(a).fill(_NAN_BITS[dtype])
    return a


def device_inputs(rng, shape_q, shape_kv, dtype, scale=1.0):
    q, k, v = random_inputs(rng, shape_q, shape_kv, dtype, scale)
    return tuple(to_device(a) for a in (q, k, v))


def forward_poisoned(q, k, v, *, causal=False, scale=None, layout="bhsd"):
    """cuda.forward into NaN-poisoned o and lse (the backend contract cuflash.attention uses).

    Checks that q, k, v are unchanged bit for bit; returns (o, lse) on the device."""
    before = [raw(a).copy() for a in (q, k, v)]
    p = _problem.validate_forward(q, k, v, causal=causal, scale=scale, layout=layout)
    o = poisoned(p.q_shape(), p.dtype)
    lse = poisoned(p.lse_shape(), FLOAT32)
    o4, lse3 = to_bhsd(o, p, p.hq, p.nq), lse.reshape((p.batch, p.hq, p.nq))
    assert is_view_of(o4, o) and is_view_of(lse3, lse)
    q4, k4, v4 = to_bhsd(q, p, p.hq, p.nq), to_bhsd(k, p, p.hkv, p.nk), to_bhsd(v, p, p.hkv, p.nk)
    cuda.forward(p, q4, k4, v4, o4, lse3)
    assert_unchanged((q, k, v), before)
    return o, lse


def assert_unchanged(arrays, before):
    for name, a, b in zip("qkv", arrays, before):
        assert bool(cupy.array_equal(raw(a), b)), f"{name} was modified by the forward"


def bhsd_host(a, layout):
    """Host copy in (..., H, N, d) order."""
    h = to_host(a)
    return h if layout == "bhsd" or h.ndim == 2 else np.swapaxes(h, -3, -2)


def row_windows(rng, nq):
    """All rows for short sequences; else the first, a random and the last window of rows."""
    if nq <= _FULL_CHECK_ROWS:
        return [(0, nq)]
    mid = int(rng.integers(_WINDOW, nq - 2 * _WINDOW))
    return [(0, _WINDOW), (mid, mid + _WINDOW), (nq - _WINDOW, nq)]


def _exact_subproblems(causal, nq, nk, r0, r1):
    """[(row0, row1, keys, causal)] of smaller problems whose rows are exactly rows [r0, r1).

    Row i sees keys j <= i + off. Rows [a, b) with keys [0, b + off) and a bottom-right
    diagonal see j <= (i - a) + (b + off) - (b - a) = i + off: the same keys. Rows whose
    diagonal reaches past the last key (top_left with nq > nk) see every key: no mask."""
    mode = causal_mode(causal)  # the oracle's own reading of causal=, not cuflash.core.masks
    if mode is None:
        return [(r0, r1, nk, False)]
    off = 0 if mode == "top_left" else nk - nq
    split = min(max(nk - off, r0), r1)  # first row that sees all nk keys
    parts = []
    if split > r0:
        parts.append((r0, split, max(0, split + off), "bottom_right"))
    if r1 > split:
        parts.append((split, r1, nk, False))
    return parts


def check_rows(o, lse, q, k, v, *, causal=False, scale=None, layout="bhsd", rng=None):
    """The naive-error rule for o and lse on all rows, or on windows of rows for long queries."""
    qh, kh, vh, oh = (bhsd_host(a, layout) for a in (q, k, v, o))
    lh = to_host(lse)
    dtype = qh.dtype
    assert oh.dtype == dtype and lh.dtype == FLOAT32
    nq, nk = qh.shape[-2], kh.shape[-2]
    windows = [(0, nq)] if rng is None else row_windows(rng, nq)
    for r0, r1 in windows:
        for a, b, keys, sub_causal in _exact_subproblems(causal, nq, nk, r0, r1):
            args = (qh[..., a:b, :], kh[..., :keys, :], vh[..., :keys, :])
            try:
                assert_forward_accurate(oh[..., a:b, :], lh[..., a:b], *args, causal=sub_causal, scale=scale)
            except AssertionError as exc:
                raise AssertionError(f"rows {a}:{b}: {exc}") from exc


def shapes(layout, batch, hq, hkv, nq, nk, d):
    if layout == "bhsd":
        return batch + (hq, nq, d), batch + (hkv, nk, d)
    return batch + (nq, hq, d), batch + (nk, hkv, d)


def run_and_check(rng, dtype, batch, hq, hkv, nq, nk, d, *, causal, layout="bhsd", scale=None, input_scale=1.0):
    sq, skv = shapes(layout, batch, hq, hkv, nq, nk, d)
    q, k, v = device_inputs(rng, sq, skv, dtype, input_scale)
    o, lse = forward_poisoned(q, k, v, causal=causal, scale=scale, layout=layout)
    check_rows(o, lse, q, k, v, causal=causal, scale=scale, layout=layout, rng=rng)
    return o, lse


# ----------------------------------------------------------------------------- accuracy grid


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("d", [32, 40, 64, 96, 111, 128, 192, 256])
def test_head_dims(rng, kernels, dtype, causal, d):
    # Every padded bucket (32, 64, 128, 192, 256), head dims below it (zero-filled columns) and
    # odd ones (scalar loads); lengths not multiples of any tile; GQA 2:1.
    layout = "bshd" if d in (40, 111, 192) else "bhsd"
    run_and_check(rng, dtype, (2,), 4, 2, 113, 203, d, causal=causal, layout=layout)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [pytest.param(False, id="full"), pytest.param(True, id="causal")])
@pytest.mark.parametrize("n", [1, 17, 97, 128, 200, 1023, 1025, 4096])
def test_sequence_lengths(rng, kernels, dtype, causal, n):
    d = 64 if n % 2 else 128
    run_and_check(rng, dtype, (1,), 2, 2, n, n, d, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("nq, nk", [(1, 239), (113, 203), (1024, 1023), (1023, 1024)])
def test_rectangular(rng, kernels, dtype, causal, nq, nk):
    # (1024, 1023) bottom-right: row 0 sees no key. (1, 239): decode-like single query.
    run_and_check(rng, dtype, (1,), 2, 1, nq, nk, 96, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("hq, hkv", [(32, 8), (8, 1)])
def test_grouped_query_heads(rng, kernels, dtype, layout, hq, hkv):
    run_and_check(rng, dtype, (1,), hq, hkv, 256, 256, 128, causal=True, layout=layout)


@pytest.mark.parametrize("dtype", DTYPES)
def test_explicit_scale_and_peaked_scores(rng, kernels, dtype):
    # Larger logits: the running max moves often and probabilities are far from uniform.
    run_and_check(rng, dtype, (2,), 2, 2, 300, 333, 64, causal=False, scale=0.37, input_scale=(3.0, 2.0, 1.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_strided_views_and_out(rng, dtype, layout):
    # Inputs are slices of larger arrays (odd element offsets: no 16-byte alignment, row strides
    # not multiples of 8), two batch axes; out= is itself a slice of a larger poisoned array.
    batch, hq, hkv, nq, nk, d = (2, 3), 4, 2, 150, 170, 64
    sq, skv = shapes(layout, batch, hq + 1, hkv + 1, nq + 3, nk + 2, d + 5)
    big_q, big_k, big_v = (to_device(random_array(rng, s, dtype)) for s in (sq, skv, skv))
    if layout == "bhsd":
        q, k, v = big_q[..., 1:, 3:, 1 : 1 + d], big_k[..., :hkv, 2:, 5:], big_v[..., 1:, :nk, 2 : 2 + d]
    else:
        q, k, v = big_q[..., 3:, 1:, 1 : 1 + d], big_k[..., 2:, :hkv, 5:], big_v[..., :nk, 1:, 2 : 2 + d]
    p = _problem.validate_forward(q, k, v, causal=True, layout=layout)
    assert (p.hq, p.hkv, p.nq, p.nk, p.d) == (hq, hkv, nq, nk, d)
    big_o = poisoned(batch + (p.q_shape()[-3] + 2, p.q_shape()[-2] + 1, d + 3), dtype)
    out = big_o[..., 1 : 1 + p.q_shape()[-3], : p.q_shape()[-2], 2 : 2 + d]
    before = [raw(a).copy() for a in (q, k, v)]
    o, lse = cuflash.attention(q, k, v, causal=True, layout=layout, return_lse=True, out=out)
    assert o is out
    assert_unchanged((q, k, v), before)
    check_rows(o, lse, q, k, v, causal=True, layout=layout)
    # Elements of the big array outside the view stay poisoned.
    outside = raw(big_o).copy()
    raw(outside)[..., 1 : 1 + p.q_shape()[-3], : p.q_shape()[-2], 2 : 2 + d] = _NAN_BITS[np.dtype(dtype)]
    assert bool(cupy.all(raw(outside) == _NAN_BITS[np.dtype(dtype)])), "the forward wrote outside out="


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dim_stride_not_one(rng, dtype):
    # q, k, v with a non-unit stride along d (every other column): the backend copies them.
    nq, nk, d = 100, 130, 48
    big = [to_device(random_array(rng, (1, 2, n, 2 * d), dtype)) for n in (nq, nk, nk)]
    q, k, v = (a[..., ::2] for a in big)
    assert q.strides[-1] == 2 * q.itemsize
    o, lse = forward_poisoned(q, k, v, causal="top_left")
    check_rows(o, lse, q, k, v, causal="top_left")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nq,nk", [(200, 300), (2, 3000)], ids=["prefill", "decode"])
def test_out_with_strided_head_dim(rng, dtype, nq, nk):
    # out= whose head dim is not contiguous (every other column of a poisoned array, and a
    # column-major one): the kernels write unit-stride rows, so attention computes into a scratch
    # array and copies it in. (Until 2026-11-30 the decode kernel wrote such an out= as if its
    # rows were contiguous, a silent wrong answer, and the prefill path raised ValueError.)
    q, k, v = device_inputs(rng, (2, 8, nq, 64), (2, 2, nk, 64), dtype)
    want_o, want_lse = cuflash.attention(q, k, v, return_lse=True)
    check_rows(want_o, want_lse, q, k, v)
    big = poisoned((2, 8, nq, 128), dtype)
    every_other = big[..., ::2]
    column_major = poisoned(q.shape[::-1], dtype).transpose(3, 2, 1, 0)
    for out in (every_other, column_major):
        assert out.strides[-1] != out.itemsize
        o, lse = cuflash.attention(q, k, v, return_lse=True, out=out)
        assert o is out
        np.testing.assert_array_equal(raw(o).get(), raw(want_o).get())
        np.testing.assert_array_equal(lse.get(), want_lse.get())
    assert bool(cupy.all(raw(big)[..., 1::2] == _NAN_BITS[np.dtype(dtype)])), "the forward wrote outside out="


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_head_2d_inputs(rng, dtype):
    q, k, v = device_inputs(rng, (77, 40), (91, 40), dtype)
    o, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, out=poisoned((77, 40), dtype))
    assert o.shape == (77, 40) and lse.shape == (77,)
    check_rows(o, lse, q, k, v, causal=True)


# ----------------------------------------------------------------------------- exact properties

@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_that_see_no_key(rng, dtype):
    # Bottom-right with Nq > Nk: the first Nq - Nk rows see nothing -> o exactly 0, lse -inf.
    nq, nk = 300, 100
    q, k, v = device_inputs(rng, (2, 2, nq, 64), (2, 1, nk, 64), dtype)
    o, lse = forward_poisoned(q, k, v, causal="bottom_right")
    oh, lh = to_host(o).astype(np.float64), to_host(lse)
    blind = nq - nk
    assert np.all(oh[..., :blind, :] == 0.0), "rows with no visible key must give o = 0"
    assert np.all(lh[..., :blind] == -np.inf), "rows with no visible key must give lse = -inf"
    assert np.all(np.isfinite(lh[..., blind:]))
    check_rows(o, lse, q, k, v, causal="bottom_right")


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_keys_at_all(rng, dtype):
    q = to_device(random_array(rng, (1, 2, 37, 64), dtype))
    k = v = cupy.empty((1, 2, 0, 64), dtype=dtype)
    o, lse = forward_poisoned(q, k, v)
    assert np.all(to_host(o).astype(np.float64) == 0.0)
    assert np.all(to_host(lse) == -np.inf)


@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_hopper_runs_the_wgmma_kernel(rng, monkeypatch, dtype, d):
    # On sm_90 the default path must be the wgmma kernel (else its tests above would silently
    # test the fallback twice).
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("not a Hopper GPU: the wgmma kernel does not apply")
    launched = record_launches(monkeypatch, forward_kernels)
    # A short key range runs the persistent kernel where HOPPER_FORWARD_PERSISTENT has a rule
    # (d = 64, 128; d=64 without a mask at any length), a long one the table's tile: both are what
    # plan_hopper.default_tile names.
    for nk in (150, 4000):
        launched.clear()
        q, k, v = device_inputs(rng, (1, 2, 130, d), (1, 2, nk, d), dtype)
        o, lse = forward_poisoned(q, k, v)
        tile = plan_hopper.default_tile(d, None, 130, nk)
        rule = schedule.persistent_rule(schedule.head_dim_bucket(d), False, nk)
        assert tile == (rule.tile if rule else schedule.HOPPER_FORWARD_TILES[schedule.head_dim_bucket(d)])
        # (a grid of fewer query tiles than SMs runs the key split on the table's tile)
        p = _problem.validate_forward(q, k, v)
        auto = plan_hopper.auto_split(p, cupy.cuda.Device().attributes["MultiProcessorCount"])
        if auto:  # a grid under one wave: its tiles split by keys
            want = [plan_hopper.split_spec(dtype, d, auto[0])[0].expression]
        else:
            want = [plan_hopper.forward_spec(dtype, d, False, tile)[0].expression]
        assert launched == want
        check_rows(o, lse, q, k, v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bitwise_repeatable(rng, dtype):
    # 250 launches into re-poisoned outputs give the same bits (no atomics, fixed reduction order).
    q, k, v = device_inputs(rng, (2, 4, 300, 64), (2, 2, 300, 64), dtype)
    o0, lse0 = forward_poisoned(q, k, v, causal=True)
    check_rows(o0, lse0, q, k, v, causal=True)
    bits_o, bits_l = raw(o0).copy(), raw(lse0).copy()
    out = cupy.empty_like(o0)
    mismatches = cupy.zeros((), dtype=np.int64)
    for _ in range(249):
        raw(out).fill(_NAN_BITS[np.dtype(dtype)])
        o, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, out=out)
        mismatches += cupy.count_nonzero(raw(o) != bits_o) + cupy.count_nonzero(raw(lse) != bits_l)
    assert int(mismatches) == 0, f"{int(mismatches)} output elements differed between identical launches"


def _round_up(n, granule=512):
    return -(-n // granule) * granule


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_device_allocation_beyond_lse(rng, dtype):
    # With out= given, the only device memory a forward may allocate is the returned lse.
    q, k, v = device_inputs(rng, (2, 4, 500, 128), (2, 2, 600, 128), dtype)
    out = poisoned(q.shape, dtype)
    cuflash.attention(q, k, v, causal=True, return_lse=True, out=out)  # compile and warm up
    pool = cupy.get_default_memory_pool()
    raw(out).fill(_NAN_BITS[np.dtype(dtype)])
    cupy.cuda.Device().synchronize()
    used_before = pool.used_bytes()
    (o, lse), requests = recorded_allocations(lambda: cuflash.attention(q, k, v, causal=True, return_lse=True, out=out))
    used_after = pool.used_bytes()
    assert o is out
    assert requests == [lse.nbytes], f"device allocations during the forward: {requests}, want only lse ({lse.nbytes} B)"
    assert used_after - used_before == _round_up(lse.nbytes), (
        f"pool grew by {used_after - used_before} B, want lse's {lse.nbytes} B rounded up to 512"
    )
    check_rows(o, lse, q, k, v, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_runs_on_current_stream(rng, dtype):
    # On a non-blocking stream: spin, then write q, then attend. A launch on any other stream
    # would run during the spin and read the poisoned q (NaN output).
    qh, kh, vh = random_inputs(rng, (1, 2, 200, 64), (1, 2, 230, 64), dtype)
    q_src, k, v = to_device(qh), to_device(kh), to_device(vh)

    def queue(q):  # copy q in, then attend into a poisoned out
        raw(q)[...] = raw(q_src)
        return cuflash.attention(q, k, v, causal=True, return_lse=True, out=poisoned(q.shape, dtype))

    queue(poisoned(q_src.shape, dtype))  # compile every kernel of the sequence outside the timed window
    spin = cupy.RawKernel(
        'extern "C" __global__ void spin(long long cycles) {'
        " long long t0 = clock64(); while (clock64() - t0 < cycles) {} }",
        "spin",
    )
    khz = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["clockRate"]
    q = poisoned(q_src.shape, dtype)
    cupy.cuda.Device().synchronize()  # inputs and q's poison are in place before the stream starts
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        spin((1,), (1,), (np.int64(khz * 500),))  # ~0.5 s
        o, lse = queue(q)
        done = stream.record()
    assert not done.done, "the spin finished before the forward was queued: the check would be vacuous"
    stream.synchronize()
    check_rows(o, lse, q, k, v, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_beyond_grid_limit(rng, dtype):
    # 70000 batch entries: more than the 65535 blocks grid.z allows in one launch.
    o, lse = run_and_check(rng, dtype, (70000,), 1, 1, 3, 5, 32, causal="top_left")
    assert o.shape[0] == 70000


def _round_up_to(n, m):
    return -(-n // m) * m


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", ["rows", "batch"])
def test_offsets_beyond_2_31_elements(rng, dtype, axis):
    # Strided views into buffers of more than 2^31 elements, so that element offsets overflow
    # 32-bit arithmetic:
    #   "rows":  q, k, v rows 2^31 / 60 elements apart, so every product the kernels form (query
    #            tile start x row stride, key tile start x row stride, row within a tile x row
    #            stride for rows >= 60) passes 2^31; o is an ordinary array. ~9 GB (16-bit) or
    #            ~18.5 GB (float32).
    #   "batch": batch 1 of q, k, v and o starts past 2^31 elements. 2 x 4.3 GB or 2 x 8.6 GB.
    # Only the viewed rows are written; q, k and v rows sit side by side in one buffer.
    d = 128
    slot = 3 * d
    if axis == "rows":
        b, h, n = 1, 2, 130
        sn = _round_up_to(-(-(2**31 + 2**20) // 60), 64)
        sh, sb = slot, slot * h
        size = (n - 1) * sn + b * sb
        assert 60 * sn > 2**31 and 64 * sn > 2**31
    else:
        b, h, n = 2, 2, 200
        sh, sn = slot, slot * h
        sb = _round_up_to(2**31 + 2**20, 64)
        size = sb + n * sn
    last_row = (b - 1) * sb + (h - 1) * sh + (n - 1) * sn
    assert last_row > 2**31, "the test must reach offsets past 2^31 elements"
    itemsize = np.dtype(dtype).itemsize
    strides = tuple(x * itemsize for x in (sb, sh, sn, 1))
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    buffers = []
    try:
        buffers.append(cupy.empty(size + slot, dtype=dtype))

        def view(base, offset):
            return cupy.lib.stride_tricks.as_strided(base[offset:], shape=(b, h, n, d), strides=strides)

        q, k, v = view(buffers[0], 0), view(buffers[0], d), view(buffers[0], 2 * d)
        for a in (q, k, v):
            raw(a)[...] = raw(to_device(random_array(rng, (b, h, n, d), dtype)))
        if axis == "rows":
            out = poisoned((b, h, n, d), dtype)
        else:
            buffers.append(cupy.empty(size + slot, dtype=dtype))
            out = view(buffers[1], 0)
            raw(out).fill(_NAN_BITS[np.dtype(dtype)])
        before = [raw(a).copy() for a in (q, k, v)]
        o, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, out=out)
        assert o is out
        assert_unchanged((q, k, v), before)
        check_rows(o, lse, q, k, v, causal=True)
    finally:
        buffers.clear()
        q = k = v = o = out = None
        pool.free_all_blocks()
