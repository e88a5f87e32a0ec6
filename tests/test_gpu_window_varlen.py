"""Sliding window and packed variable-length sequences on the GPU (issue #5): the band kernels.

The forward runs attn_fwd_wgmma_band on sm_90 (CUFLASH_KERNELS=auto, 16-bit aligned rows, a head
dim of HOPPER_FORWARD_TILES) and attn_fwd_band elsewhere; the forward tests take the ``kernels``
fixture so that on an H200 both run. The backward is the mma.sync band kernels everywhere.

The oracle is the float64 reference with a mask this file builds pair by pair from the documented
definition (_brute_mask), never cuflash.core.masks: a windowed problem is held to
``mask=brute_visible(...)``, a packed batch to the block-diagonal mask of its sequences (one big
problem over the packed arrays, so the varlen launch is not part of its own oracle). The rule is
cuflash.testing's: at most 2x (forward; 3x backward) the error of the naive formula in the input
dtype plus one rounding. Outputs are NaN-poisoned before every launch, so an element a kernel
forgets shows up; rows that see no key must give o = 0 and lse = -inf exactly, keys no query sees
dk = dv = 0 exactly, and the inputs must come back unchanged bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash.kernels import backward as backward_kernels
from cuflash.kernels import decode as decode_kernels
from cuflash.kernels import forward as forward_kernels
from cuflash.core import problem as _problem
from cuflash.core.arrays import BFLOAT16, FLOAT16
from cuflash.testing import assert_backward_accurate, assert_forward_accurate, random_array, random_inputs, to_numpy

from _brute_mask import block_diagonal_mask, brute_visible, packed_batch

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

DTYPES = [pytest.param(FLOAT16, id="f16"), pytest.param(BFLOAT16, id="bf16")]
CAUSAL = [pytest.param(False, id="full"), pytest.param("bottom_right", id="br"), pytest.param("top_left", id="tl")]

_UINT = {2: np.uint16, 4: np.uint32}
_NAN_BITS = {2: 0x7E00, 4: 0x7FC00000}  # float16 NaN (also a NaN as bfloat16), float32 NaN


def window_id(w):
    return "nowin" if w is None else f"w{w[0]}_{w[1]}"


# ----------------------------------------------------------------------------- helpers


def raw(a):
    return a.view(_UINT[a.dtype.itemsize])


def to_device(a):
    a = np.ascontiguousarray(a)
    return cupy.asarray(raw(a)).view(a.dtype)


def to_host(a):
    return np.asarray(to_numpy(raw(cupy.ascontiguousarray(a)))).view(a.dtype)


def poisoned(shape, dtype):
    a = cupy.empty(shape, dtype=dtype)
    raw(a).fill(_NAN_BITS[np.dtype(dtype).itemsize])
    return a


def bits(arrays):
    return [to_host(raw(a)).copy() for a in arrays]


def assert_unchanged(arrays, before):
    for a, b in zip(arrays, before):
        assert np.array_equal(to_host(raw(a)), b), "an input was modified"


def assert_hidden_rows(o, lse, vis, rows_axis):
    """Rows that see no key: o exactly 0 and lse -inf; the others a finite lse."""
    hidden = ~vis.any(axis=1)
    o32 = np.moveaxis(o.astype(np.float32), rows_axis, 0)
    assert np.all(o32[hidden] == 0), "rows that see no key must give o = 0"
    lse_rows = np.moveaxis(lse, -1, 0)
    assert np.all(lse_rows[hidden] == -np.inf), "rows that see no key must give lse = -inf"
    assert np.isfinite(lse_rows[~hidden]).all()


def record_launches(monkeypatch):
    """The expressions of every kernel that cuflash's GPU modules fetch, in order (the wgmma
    forward fetches through gpu, the wgmma backward through gpu_backward)."""
    from cuflash.api import plan_cache

    # A planned decode geometry (cuflash.api.plan_cache) launches what the planner chose when the plan
    # was made, without fetching again: record the planner's choice on every call.
    monkeypatch.setattr(plan_cache, "enabled", False)
    launched = []
    for mod in (forward_kernels, backward_kernels, decode_kernels):
        real = mod.get_function

        def recording(spec, real=real):
            launched.append(spec.expression)
            return real(spec)

        monkeypatch.setattr(mod, "get_function", recording)
    return launched


def forward_band_kernel(kernels="auto"):
    """The prefix of the forward kernel a window / packed batch must launch here (aligned 16-bit
    rows, d = 64 or 128): the wgmma band kernel on sm_90 unless CUFLASH_KERNELS=mma_sync."""
    hopper = cupy.cuda.Device().compute_capability == "90"
    return "attn_fwd_wgmma_band<" if hopper and kernels == "auto" else "attn_fwd_band<"


def window_forward(rng, dtype, b, hq, hkv, nq, nk, d, causal, window, *, layout="bhsd", out=False):
    """Forward with a window into poisoned outputs, checked against the brute-force mask."""
    sq, skv = ((b, hq, nq, d), (b, hkv, nk, d)) if layout == "bhsd" else ((b, nq, hq, d), (b, nk, hkv, d))
    qh, kh, vh = random_inputs(rng, sq, skv, dtype)
    q, k, v = (to_device(a) for a in (qh, kh, vh))
    before = bits((q, k, v))
    o_arg = poisoned(q.shape, dtype) if out else None
    o, lse = cuflash.attention(q, k, v, causal=causal, window=window, layout=layout, return_lse=True, out=o_arg)
    assert o_arg is None or o is o_arg
    assert_unchanged((q, k, v), before)
    oh, lh = to_host(o), to_host(lse)
    vis = brute_visible(causal, window, nq, nk)
    assert_forward_accurate(oh, lh, qh, kh, vh, causal=False, layout=layout, mask=vis)
    assert_hidden_rows(oh, lh, vis, -2 if layout == "bhsd" else -3)
    return (qh, kh, vh), (q, k, v), (o, lse), vis


# ----------------------------------------------------------------------------- window: forward

# Both sides bounded and cutting 128 x 64 tiles mid-way, zero-width, one-sided (right only, left
# only), and a right side reaching past the end.
WINDOWS = [(70, 20), (0, 0), (-1, 5), (130, -1), (3, 200)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("window", WINDOWS, ids=window_id)
@pytest.mark.parametrize("nq, nk", [(200, 333), (333, 200)])
def test_window_forward(rng, kernels, dtype, causal, window, nq, nk):
    # Nq != Nk either way, lengths not multiples of any tile; with Nq > Nk bottom-right, or a
    # zero-width window, some rows see no key. GQA 4:2; d = 64 and 128 (the table's two shapes).
    window_forward(rng, dtype, 2, 4, 2, nq, nk, 64 if nq < nk else 128, causal, window)


@pytest.mark.parametrize("d", [32, 40, 111, 192, 256])
def test_window_forward_head_dims(rng, kernels, d):
    # Every other head-dim bucket, the zero-filled padding (40) and the scalar-load kernel (111,
    # d % 8 != 0); d = 192 runs the band kernel's 32-key tile. bfloat16 only: each case compiles
    # its own kernel, and float16 runs the same code (the grid above covers both at d = 64, 128).
    # On sm_90 d = 192 and 256 also run the wgmma band kernel ("auto").
    window_forward(rng, BFLOAT16, 1, 2, 1, 150, 170, d, "bottom_right", (37, 5), layout="bshd" if d == 40 else "bhsd")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal, window", [(True, (100, 0)), (False, (150, 150)), ("top_left", (0, -1))])
def test_window_forward_long(rng, kernels, dtype, causal, window):
    # Many query and key tiles: tiles left of the band are skipped, tiles inside need no mask.
    window_forward(rng, dtype, 1, 2, 2, 700, 700, 64, causal, window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_window_forward_out(rng, kernels, dtype, layout):
    window_forward(rng, dtype, 2, 4, 4, 129, 131, 64, True, (20, 0), layout=layout, out=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_forward_strided_out(rng, kernels, dtype):
    # out= a slice of a larger poisoned array: the kernel writes through its strides, and nothing
    # outside the view.
    qh, kh, vh = random_inputs(rng, (2, 3, 90, 64), (2, 3, 100, 64), dtype)
    q, k, v = (to_device(a) for a in (qh, kh, vh))
    big = poisoned((2, 4, 95, 72), dtype)
    out = big[:, 1:, 2:92, 4:68]
    o, lse = cuflash.attention(q, k, v, window=(9, 9), return_lse=True, out=out)
    assert o is out
    vis = brute_visible(False, (9, 9), 90, 100)
    assert_forward_accurate(to_host(o), to_host(lse), qh, kh, vh, mask=vis)
    rest = to_host(raw(big)).copy()
    rest[:, 1:, 2:92, 4:68] = _NAN_BITS[2]
    assert np.all(rest == _NAN_BITS[2]), "the forward wrote outside out="


def test_window_routes_decode_shapes_to_decode_and_others_to_a_band_kernel(rng, monkeypatch, kernels):
    # A decode-shaped problem (few queries, long cache, 16-byte rows) with a window runs the split-KV
    # decode kernel with its band mask (attn_decode*<..., WINDOW = true>); a Hopper-shaped one
    # (d = 64 / 128, aligned) a band kernel, never the plain kernels: on sm_90 attn_fwd_wgmma_band,
    # with CUFLASH_KERNELS=mma_sync (and on other GPUs) attn_fwd_band.
    launched = record_launches(monkeypatch)
    window_forward(rng, FLOAT16, 2, 8, 2, 4, 1000, 128, True, (300, 0))
    window_forward(rng, BFLOAT16, 1, 2, 2, 256, 256, 64, False, (32, 32))
    want = forward_band_kernel(kernels)
    decode = [e for e in launched if not e.startswith("attn_decode_combine")]  # (a split merge's second launch)
    assert len(decode) == 2, launched
    assert decode[0].startswith("attn_decode") and decode[0].endswith(", true>"), launched
    assert decode[1].startswith(want), launched


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_with_kv_lens(rng, kernels, dtype):
    # kv_lens and a window: each sequence over its first kv_lens[b] keys, window aligned to it
    # (two queries over a 600-key cache: the split-KV decode kernel's band mask).
    qh, kh, vh = random_inputs(rng, (3, 4, 2, 64), (3, 2, 600, 64), dtype)
    q, k, v = (to_device(a) for a in (qh, kh, vh))
    lens = np.array([0, 300, 600], dtype=np.int32)
    o, lse = cuflash.attention(q, k, v, causal=True, window=(40, 0), kv_lens=cupy.asarray(lens), return_lse=True)
    oh, lh = to_host(o), to_host(lse)
    for b, n in enumerate(lens.tolist()):
        sl = slice(b, b + 1)
        assert_forward_accurate(oh[sl], lh[sl], qh[sl], kh[sl, :, :n], vh[sl, :, :n],
                                          mask=brute_visible(True, (40, 0), 2, n))
    assert np.all(oh[0].astype(np.float32) == 0) and np.all(lh[0] == -np.inf)


# ----------------------------------------------------------------------------- window: backward


def window_backward(rng, dtype, b, hq, hkv, nq, nk, d, causal, window, *, deterministic=False, layout="bhsd"):
    (qh, kh, vh), (q, k, v), (o, lse), vis = window_forward(rng, dtype, b, hq, hkv, nq, nk, d, causal, window,
                                                            layout=layout)
    doh = random_array(rng, qh.shape, dtype)
    do = to_device(doh)
    before = bits((do, q, k, v, o, lse))
    outs = tuple(poisoned(a.shape, dtype) for a in (q, k, v))
    grads = cuflash.attention_backward(do, q, k, v, o, lse, causal=causal, window=window, layout=layout,
                                       deterministic=deterministic, out=outs)
    assert all(g is w for g, w in zip(grads, outs))
    assert_unchanged((do, q, k, v, o, lse), before)
    gh = tuple(to_host(g) for g in grads)
    assert_backward_accurate(gh, doh, qh, kh, vh, layout=layout, mask=vis)
    seq = -2 if layout == "bhsd" else -3
    unseen = ~vis.any(axis=0)
    for g in gh[1:]:
        assert np.all(np.moveaxis(g.astype(np.float32), seq, 0)[unseen] == 0), "keys no query sees: dk = dv = 0"
    hidden = ~vis.any(axis=1)
    assert np.all(np.moveaxis(gh[0].astype(np.float32), seq, 0)[hidden] == 0), "rows that see no key: dq = 0"
    return (do, q, k, v, o, lse), gh


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("window", [(70, 20), (0, 0), (-1, 5), (130, -1)], ids=window_id)
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
def test_window_backward(rng, dtype, causal, window, deterministic):
    nq, nk = (150, 260) if deterministic else (260, 150)
    window_backward(rng, dtype, 2, 4, 2, nq, nk, 64, causal, window, deterministic=deterministic)


@pytest.mark.parametrize("d", [32, 111, 128, 192, 256])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
def test_window_backward_head_dims(rng, d, deterministic):
    # bfloat16 only, as for the forward: one compiled kernel per case.
    window_backward(rng, BFLOAT16, 1, 2, 1, 140, 150, d, "top_left", (25, 7), deterministic=deterministic,
                    layout="bshd" if d == 111 else "bhsd")


def test_window_backward_long_and_runs_band_kernels(rng, monkeypatch):
    # The forward: the band kernel of this GPU (wgmma on sm_90); the backward: the mma.sync band
    # kernels, never a wgmma one (they mask no band).
    launched = record_launches(monkeypatch)
    window_backward(rng, BFLOAT16, 1, 2, 2, 600, 640, 128, True, (90, 0))
    assert launched[0].startswith(forward_band_kernel()), launched
    bwd = launched[1:]
    assert any(e.startswith("attn_bwd_kv_band<") for e in bwd), bwd
    assert not any("wgmma" in e for e in bwd), launched


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_backward_deterministic_bitwise(rng, dtype):
    (do, q, k, v, o, lse), first = window_backward(rng, dtype, 2, 4, 2, 300, 310, 64, True, (50, 0),
                                                   deterministic=True)
    for _ in range(20):
        again = cuflash.attention_backward(do, q, k, v, o, lse, causal=True, window=(50, 0), deterministic=True)
        for a, b in zip(first, again):
            assert np.array_equal(raw(a), to_host(raw(b)))


# ----------------------------------------------------------------------------- packed sequences


def varlen_run(rng, dtype, nqs, nks, causal, window, *, hq=4, hkv=2, d=64, deterministic=False, out=False):
    """Packed forward and backward into poisoned outputs, held to the block-diagonal mask."""
    qh, kh, vh, cq, ck = packed_batch(rng, dtype, nqs, nks, hq, hkv, d)
    q, k, v = (to_device(a) for a in (qh, kh, vh))
    cq_d, ck_d = cupy.asarray(cq), cupy.asarray(ck)
    kw = dict(causal=causal, window=window, cu_seqlens_q=cq_d, cu_seqlens_k=ck_d)
    before = bits((q, k, v, cq_d, ck_d))
    o_arg = poisoned(q.shape, dtype) if out else None
    o, lse = cuflash.attention(q, k, v, return_lse=True, out=o_arg, **kw)
    assert o_arg is None or o is o_arg
    assert o.shape == q.shape and lse.shape == (hq, q.shape[0]) and lse.dtype == np.float32
    oh, lh = to_host(o), to_host(lse)
    vis = block_diagonal_mask(causal, window, cq, ck)
    assert_forward_accurate(oh, lh, qh, kh, vh, layout="bshd", mask=vis)
    assert_hidden_rows(oh, lh, vis, 0)
    doh = random_array(rng, qh.shape, dtype)
    do = to_device(doh)
    outs = tuple(poisoned(a.shape, dtype) for a in (q, k, v)) if out else None
    grads = cuflash.attention_backward(do, q, k, v, o, lse, deterministic=deterministic, out=outs, **kw)
    assert outs is None or all(g is w for g, w in zip(grads, outs))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    gh = tuple(to_host(g) for g in grads)
    assert_backward_accurate(gh, doh, qh, kh, vh, layout="bshd", mask=vis)
    unseen = ~vis.any(axis=0)
    assert np.all(gh[1][unseen].astype(np.float32) == 0) and np.all(gh[2][unseen].astype(np.float32) == 0)
    assert np.all(gh[0][~vis.any(axis=1)].astype(np.float32) == 0)
    assert_unchanged((q, k, v, cq_d, ck_d), before)
    return (do, q, k, v, o, lse, kw), gh


# Nq in {1, 2, 7, 16} per sequence, empty sequences on either side and both, Nq > Nk and Nq < Nk,
# and sequences of more than two 128-row (and 64-/128-key) tiles.
BATCHES = [
    pytest.param([1, 0, 2, 7, 16, 0, 300], [9, 4, 0, 3, 40, 0, 290], id="mixed"),
    pytest.param([16, 1, 2, 7, 270], [16, 30, 1, 7, 400], id="no-empty"),
    pytest.param([0, 7, 0], [0, 20, 5], id="leading-empty"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("window", [None, (3, 0), (2, 2), (-1, 1), (50, -1)], ids=window_id)
@pytest.mark.parametrize("nqs, nks", BATCHES)
def test_varlen(rng, kernels, dtype, causal, window, nqs, nks):
    varlen_run(rng, dtype, nqs, nks, causal, window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_deterministic_out_and_bitwise(rng, dtype, causal):
    (do, q, k, v, o, lse, kw), first = varlen_run(rng, dtype, [5, 0, 200, 16], [7, 3, 180, 300], causal, (40, 10),
                                                  deterministic=True, out=True)
    for _ in range(10):
        again = cuflash.attention_backward(do, q, k, v, o, lse, deterministic=True, **kw)
        for a, b in zip(first, again):
            assert np.array_equal(raw(a), to_host(raw(b)))


@pytest.mark.parametrize("d, hq, hkv", [(32, 8, 1), (111, 2, 2), (128, 8, 2), (192, 4, 4), (256, 2, 1)])
def test_varlen_head_dims_and_groups(rng, kernels, d, hq, hkv):
    varlen_run(rng, BFLOAT16, [3, 150, 0, 16], [40, 140, 9, 16], True, None, hq=hq, hkv=hkv, d=d)


def test_varlen_is_one_launch_per_kernel(rng, monkeypatch, kernels):
    # Packed sequences run in one launch of each kernel, not one per sequence: the forward's band
    # kernel of this GPU (attn_fwd_wgmma_band on sm_90 unless mma_sync), the mma.sync backward.
    launched = record_launches(monkeypatch)
    varlen_run(rng, FLOAT16, [1, 2, 7, 16, 130], [5, 2, 20, 16, 140], "bottom_right", None)
    fwd = [e for e in launched if e.startswith("attn_fwd")]
    kv = [e for e in launched if e.startswith("attn_bwd_kv")]
    assert len(fwd) == 1 and fwd[0].startswith(forward_band_kernel(kernels)), launched
    assert len(kv) == 1 and kv[0].startswith("attn_bwd_kv_band<"), launched


def test_varlen_strided_out(rng, kernels):
    # out= a slice of a larger array, for o and the three gradients.
    qh, kh, vh, cq, ck = packed_batch(rng, FLOAT16, [9, 130], [20, 100], 2, 2, 64)
    q, k, v = (to_device(a) for a in (qh, kh, vh))
    kw = dict(causal=True, cu_seqlens_q=cupy.asarray(cq), cu_seqlens_k=cupy.asarray(ck))
    big_o = poisoned((q.shape[0], 3, 80), FLOAT16)
    o, lse = cuflash.attention(q, k, v, return_lse=True, out=big_o[:, 1:, 8:72], **kw)
    vis = block_diagonal_mask(True, None, cq, ck)
    assert_forward_accurate(to_host(o), to_host(lse), qh, kh, vh, layout="bshd", mask=vis)
    doh = random_array(rng, qh.shape, FLOAT16)
    bigs = [poisoned((a.shape[0], 3, 80), FLOAT16) for a in (q, k, v)]
    grads = cuflash.attention_backward(to_device(doh), q, k, v, o, lse, out=tuple(b[:, 1:, 8:72] for b in bigs),
                                       **kw)
    assert_backward_accurate(tuple(to_host(g) for g in grads), doh, qh, kh, vh, layout="bshd", mask=vis)
    for big in [big_o] + bigs:
        rest = to_host(raw(big)).copy()
        rest[:, 1:, 8:72] = _NAN_BITS[2]
        assert np.all(rest == _NAN_BITS[2]), "a kernel wrote outside out="


def test_varlen_float32_is_not_implemented(rng):
    qh, kh, vh, cq, ck = packed_batch(rng, np.float32, [3, 4], [5, 6], 2, 2, 32)
    q, k, v = (cupy.asarray(a) for a in (qh, kh, vh))
    with pytest.raises(NotImplementedError, match="float32 GPU inputs"):
        cuflash.attention(q, k, v, cu_seqlens_q=cupy.asarray(cq), cu_seqlens_k=cupy.asarray(ck))
    with pytest.raises(NotImplementedError, match="float32 GPU inputs"):
        cuflash.attention(q[None], k[None], v[None], window=(3, 3), layout="bshd")


def test_varlen_bad_offsets_still_name_the_argument(rng):
    qh, kh, vh, cq, ck = packed_batch(rng, FLOAT16, [3, 4], [5, 6], 2, 2, 32)
    q, k, v = (to_device(a) for a in (qh, kh, vh))
    with pytest.raises(ValueError, match=r"^cu_seqlens_k: offsets must be non-decreasing"):
        cuflash.attention(q, k, v, cu_seqlens_q=cupy.asarray(cq), cu_seqlens_k=cupy.asarray(np.array([0, 7, 6], dtype=np.int32)))
    with pytest.raises(TypeError, match=r"^cu_seqlens_q: expected dtype int32"):
        cuflash.attention(q, k, v, cu_seqlens_q=cupy.asarray(cq.astype(np.int64)), cu_seqlens_k=cupy.asarray(ck))


def test_varlen_more_sequences_than_grid_z(rng):
    # 70000 packed sequences (more than the 65535 blocks grid z takes in one launch), each 1 query
    # and 2 keys: the same problem as a uniform batch of 70000, which the oracle computes instead
    # of a 70000 x 140000 block-diagonal mask.
    n, hq, hkv, d = 70000, 2, 1, 32
    qh, kh, vh, cq, ck = packed_batch(rng, BFLOAT16, [1] * n, [2] * n, hq, hkv, d)
    q, k, v = (to_device(a) for a in (qh, kh, vh))
    kw = dict(causal=True, window=(1, 0), cu_seqlens_q=cupy.asarray(cq), cu_seqlens_k=cupy.asarray(ck))
    o, lse = cuflash.attention(q, k, v, return_lse=True, out=poisoned(q.shape, BFLOAT16), **kw)
    uq, uk, uv = qh.reshape(n, 1, hq, d), kh.reshape(n, 2, hkv, d), vh.reshape(n, 2, hkv, d)
    lh = to_host(lse)  # (Hq, total_q): as the uniform problem's (B, Hq, 1)
    assert_forward_accurate(to_host(o).reshape(uq.shape), lh.T.reshape(n, hq, 1), uq, uk, uv,
                                      causal=True, layout="bshd")
    doh = random_array(rng, qh.shape, BFLOAT16)
    grads = cuflash.attention_backward(to_device(doh), q, k, v, o, lse, **kw)
    gh = [to_host(g).reshape(s) for g, s in zip(grads, (uq.shape, uk.shape, uv.shape))]
    assert_backward_accurate(gh, doh.reshape(uq.shape), uq, uk, uv, causal=True, layout="bshd")


# ----------------------------------------------------------------------------- max_seqlen_*: no host read


def _no_host_reads(monkeypatch):
    """Every host read of an argument goes through core.problem.to_host: make it fail the test."""
    def refuse(a, name, why):
        raise AssertionError(f"{name} was read on the host")
    monkeypatch.setattr(_problem, "to_host", refuse)


@pytest.mark.parametrize("slack", [0, 37], ids=["exact", "longer"])
@pytest.mark.parametrize("causal, window", [(False, None), ("bottom_right", (40, 10))], ids=["full", "br-window"])
def test_varlen_max_seqlens_read_no_offsets_and_equal_the_validated_call(rng, monkeypatch, kernels, slack, causal,
                                                                         window):
    # FlashAttention's max_seqlen_q / max_seqlen_k with validate=False: the grids are sized from them,
    # no offset reaches the host, and every output is bitwise the validated call's (which varlen_run
    # holds to the block-diagonal reference), for exact maxima and for longer ones (empty blocks).
    nqs, nks = [5, 0, 200, 16, 1], [7, 3, 180, 300, 9]
    (do, q, k, v, o, lse, kw), grads = varlen_run(rng, BFLOAT16, nqs, nks, causal, window)
    lengths = dict(max_seqlen_q=max(nqs) + slack, max_seqlen_k=max(nks) + slack, validate=False)
    before = bits((q, k, v, do, kw["cu_seqlens_q"], kw["cu_seqlens_k"]))
    _no_host_reads(monkeypatch)
    o2, lse2 = cuflash.attention(q, k, v, return_lse=True, out=poisoned(q.shape, BFLOAT16), **kw, **lengths)
    outs = tuple(poisoned(a.shape, BFLOAT16) for a in (q, k, v))
    grads2 = cuflash.attention_backward(do, q, k, v, o2, lse2, out=outs, **kw, **lengths)
    monkeypatch.undo()
    assert np.array_equal(to_host(raw(o2)), to_host(raw(o)))
    assert np.array_equal(to_host(lse2), to_host(lse))
    for g, g2 in zip(grads, grads2):
        assert np.array_equal(raw(g), to_host(raw(g2)))
    assert_unchanged((q, k, v, do, kw["cu_seqlens_q"], kw["cu_seqlens_k"]), before)


@pytest.mark.parametrize("offsets", [[0, -50, 7, 3, 10**9], [0, 400, 2, 2**31 - 1, -(2**31)]],
                         ids=["negative-and-huge", "decreasing-and-extremes"])
def test_unvalidated_offsets_stay_inside_the_packed_arrays(rng, kernels, offsets):
    # Offsets nobody checked (validate=False with max_seqlen_*): the kernels clamp them into the
    # packed arrays, so no launch faults and nothing outside o / dq / dk / dv is written (each is
    # the middle of a larger poisoned buffer). Their values are the caller's promise, so only
    # memory safety is asserted, and that a later valid call is still exact.
    total_q, total_k, hq, hkv, d = 90, 120, 4, 2, 64
    qh, kh, vh = random_inputs(rng, (total_q, hq, d), (total_k, hkv, d), BFLOAT16)
    q, k, v = (to_device(a) for a in (qh, kh, vh))
    cu = cupy.asarray(np.array(offsets, np.int32))
    lengths = dict(max_seqlen_q=64, max_seqlen_k=64, validate=False)
    pad = 3
    big = {name: poisoned((n + 2 * pad, h, d), BFLOAT16) for name, n, h in
           (("o", total_q, hq), ("dq", total_q, hq), ("dk", total_k, hkv), ("dv", total_k, hkv))}
    inner = {name: b[pad:-pad] for name, b in big.items()}
    o, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, out=inner["o"], cu_seqlens_q=cu,
                               cu_seqlens_k=cu, **lengths)
    do = to_device(random_array(rng, qh.shape, BFLOAT16))
    cuflash.attention_backward(do, q, k, v, o, lse, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                               out=(inner["dq"], inner["dk"], inner["dv"]), **lengths)
    cupy.cuda.Device().synchronize()  # a fault would surface here
    for name, b in big.items():
        edge = to_host(raw(b))[np.r_[0:pad, -pad:0]]
        assert np.all(edge == _NAN_BITS[2]), f"a kernel wrote outside {name}"
    varlen_run(rng, BFLOAT16, [5, 40], [9, 30], True, None)


@pytest.mark.parametrize("n", [1, 2, 5, 1024, 1025, 5000, 70001])
def test_offsets_clamp_matches_its_definition(rng, n):
    # The device pass over unread offsets: each clamped into [0, total], then raised to the largest
    # offset before it (a running maximum), for q's and k's arrays at once; valid offsets unchanged.
    from cuflash.backends import cuda as cuda_backend

    total_q, total_k = 1000, 37
    cq = rng.integers(-50, total_q + 50, n).astype(np.int32)
    extremes = rng.random(n) < 0.1
    cq[extremes] = rng.choice(np.array([-2**31, 2**31 - 1], np.int64), int(extremes.sum()))
    ck = np.sort(rng.integers(0, total_k + 1, n)).astype(np.int32)
    got_q, got_k = cuda_backend.clamp_packed_offsets(cupy.asarray(cq), cupy.asarray(ck), total_q, total_k)
    want_q = np.maximum.accumulate(np.clip(cq.astype(np.int64), 0, total_q))
    assert np.array_equal(to_numpy(got_q), want_q)
    assert np.array_equal(to_numpy(got_k), ck)  # valid (sorted, inside) offsets come back unchanged
