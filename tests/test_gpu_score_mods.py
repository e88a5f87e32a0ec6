"""Score modifiers (softcap, ALiBi slopes, sinks) on the GPU against the float64 oracle, by the
accuracy rule (cuflash.testing): the forward (on sm_90 without a window attn_fwd_wgmma_tma_mod, or
attn_fwd_wgmma_tma_persistent_mod on the plain kernel's persistent tiles, else attn_fwd_band_mod; decode shapes attn_decode_mod, see test_gpu_decode_mods.py) and the backward (softcap and ALiBi: on sm_90, d <= 128, atomic dQ
attn_bwd_kv_wgmma_ws_mod, else attn_bwd_kv_band_mod / attn_bwd_dq_band_mod; sinks: the plain
kernels and D), both kernel selections, masked rows, GQA, windows, packed, kv_lens and paged inputs. Every allocation cuflash makes is
filled with NaN bytes first (cuflash.testing.poisoned_allocations), so an output element a kernel
forgets shows; inputs are compared bit for bit afterwards."""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash.core.arrays import BFLOAT16, FLOAT16, FLOAT32
from cuflash.testing import (assert_backward_accurate, assert_forward_accurate, poisoned_allocations, random_array,
                             random_inputs)

from test_paged import paged_cache
from test_score_mods import make_mods

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

DTYPES = [pytest.param(FLOAT16, id="f16"), pytest.param(BFLOAT16, id="bf16")]
_UINT = {2: np.uint16, 4: np.uint32}


def to_device(a):
    a = np.ascontiguousarray(a)
    return cupy.asarray(a.view(_UINT[a.dtype.itemsize])).view(a.dtype)


def to_host(a):
    return cupy.ascontiguousarray(a).view(_UINT[a.dtype.itemsize]).get().view(a.dtype)


def on_device(mods):
    return {n: (to_device(v) if isinstance(v, np.ndarray) else v) for n, v in mods.items()}


def run(q, k, v, do, mods, deterministic=False, **kw):
    """Forward and backward on the device with every allocation poisoned; (o, lse, grads) on the host."""
    dev = [to_device(a) for a in (q, k, v, do)]
    dmods = on_device(mods)
    before = [to_host(a).tobytes() for a in dev]

    def go():
        o, lse = cuflash.attention(*dev[:3], return_lse=True, **kw, **dmods)
        grads = cuflash.attention_backward(dev[3], *dev[:3], o, lse, deterministic=deterministic, **kw, **dmods)
        return o, lse, grads

    o, lse, grads = poisoned_allocations(go)
    assert [to_host(a).tobytes() for a in dev] == before, "an input was modified"
    return to_host(o), lse.get(), tuple(to_host(g) if g.dtype != FLOAT32 else g.get() for g in grads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", ["softcap", "alibi", "alibi_batch", "sinks", "all"])
@pytest.mark.parametrize("causal", [False, "bottom_right", "top_left"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("deterministic", [False, True])
def test_forward_backward(rng, kernels, dtype, which, causal, d, deterministic):
    b, hq, hkv, nq, nk = 2, 4, 2, 333, 200  # GQA; bottom-right: the first 133 rows see no key
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), dtype)
    do = random_array(rng, q.shape, dtype)
    mods = make_mods(rng, which, hq, b)
    o, lse, grads = run(q, k, v, do, mods, deterministic=deterministic, causal=causal)
    assert_forward_accurate(o, lse, q, k, v, causal=causal, **mods)
    assert len(grads) == (4 if "sinks" in mods else 3)
    assert_backward_accurate(grads, do, q, k, v, causal=causal, **mods)


@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_persistent_blocks_walk_modified_tiles(rng, causal):
    """Short sequences run the modifiers on the plain kernel's persistent tile (plan.hopper.mod_tile):
    with more work units than SMs each block walks several (batch entry, head) tiles and has to
    take each one's cap, slope (per batch entry and head here) and sink, and its ragged last rows."""
    from cuflash.plan import hopper

    b, hq, hkv, n, d = 3, 16, 4, 1000, 128
    tile = hopper.mod_tile(d, causal, n, n)
    tiles = -(-n // tile.block_m)
    units = (-(-tiles // 2) if causal else tiles) * hq * b
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    assert tile.persistent and units > sms, (tile, units, sms)
    q, k, v = random_inputs(rng, (b, hq, n, d), (b, hkv, n, d), BFLOAT16)
    do = random_array(rng, q.shape, BFLOAT16)
    mods = make_mods(rng, "all", hq, b)
    o, lse, grads = run(q, k, v, do, mods, causal=causal)
    assert_forward_accurate(o, lse, q, k, v, causal=causal, **mods)
    assert_backward_accurate(grads, do, q, k, v, causal=causal, **mods)


@pytest.mark.parametrize("d", [32, 192, 256])
def test_head_dims(rng, kernels, d):
    q, k, v = random_inputs(rng, (1, 2, 150, d), (1, 2, 170, d), BFLOAT16)
    do = random_array(rng, q.shape, BFLOAT16)
    mods = make_mods(rng, "all", 2, 1)
    o, lse, grads = run(q, k, v, do, mods, causal=True)
    assert_forward_accurate(o, lse, q, k, v, causal=True, **mods)
    assert_backward_accurate(grads, do, q, k, v, causal=True, **mods)


def test_long_rows_large_scores(rng, kernels):
    """Scores well beyond the cap (inputs x 3) over 2k keys: the capped tanh and the ALiBi bias at
    large distances."""
    q, k, v = random_inputs(rng, (1, 2, 256, 128), (1, 2, 2048, 128), FLOAT16, scale=3.0)
    do = random_array(rng, q.shape, FLOAT16)
    mods = dict(softcap=20.0, alibi_slopes=np.array([0.001, 0.03], np.float32))
    o, lse, grads = run(q, k, v, do, mods, causal=True)
    assert_forward_accurate(o, lse, q, k, v, causal=True, **mods)
    assert_backward_accurate(grads, do, q, k, v, causal=True, **mods)


def test_window_with_modifiers(rng, kernels):
    q, k, v = random_inputs(rng, (1, 4, 200, 64), (1, 2, 260, 64), FLOAT16)
    do = random_array(rng, q.shape, FLOAT16)
    mods = make_mods(rng, "all", 4, 1)
    o, lse, grads = run(q, k, v, do, mods, window=(40, 7))
    assert_forward_accurate(o, lse, q, k, v, window=(40, 7), **mods)
    assert_backward_accurate(grads, do, q, k, v, window=(40, 7), **mods)


def test_varlen_with_modifiers(rng, kernels):
    hq, hkv, d = 4, 2, 64
    nqs, nks = [70, 0, 129, 33], [90, 40, 100, 200]
    cq = np.concatenate([[0], np.cumsum(nqs)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(nks)]).astype(np.int32)
    q, k, v = random_inputs(rng, (cq[-1], hq, d), (ck[-1], hkv, d), BFLOAT16)
    do = random_array(rng, q.shape, BFLOAT16)
    mods = make_mods(rng, "all", hq, len(nqs))
    kw = dict(cu_seqlens_q=to_device(cq), cu_seqlens_k=to_device(ck), causal=True)
    o, lse, grads = run(q, k, v, do, mods, **kw)
    dsinks_cpu = np.zeros(hq, np.float64)
    for bi in range(len(nqs)):
        qs, ks = slice(cq[bi], cq[bi + 1]), slice(ck[bi], ck[bi + 1])
        seq_mods = dict(mods, alibi_slopes=mods["alibi_slopes"][bi])
        sq, sk, sv, sdo, so = (a[None].transpose(0, 2, 1, 3) for a in (q[qs], k[ks], v[ks], do[qs], o[qs]))
        assert_forward_accurate(so, lse[None, :, qs], sq, sk, sv, causal=True, **seq_mods)
        # this sequence's dsinks share by the NumPy backend (held to the rule by the CPU tests)
        share = cuflash.attention_backward(sdo, sq, sk, sv, so, lse[None, :, qs], causal=True, **seq_mods)[3]
        dsinks_cpu += share
        seq_grads = [g[None].transpose(0, 2, 1, 3) for g in (grads[0][qs], grads[1][ks], grads[2][ks])]
        assert_backward_accurate(seq_grads + [share], sdo, sq, sk, sv, causal=True, **seq_mods)
    # the GPU's summed dsinks against the CPU's sum from the same o and lse (float32 sums of the
    # same terms in another order)
    np.testing.assert_allclose(grads[3], dsinks_cpu, rtol=1e-4, atol=1e-5 * np.abs(dsinks_cpu).max())


def test_kv_lens_and_paged(rng, kernels):
    b, hq, hkv, nq, nk, d = 3, 8, 2, 4, 600, 128  # decode shapes: the split-KV kernel (test_gpu_decode_mods.py)
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), FLOAT16)
    lens = np.array([600, 17, 333], np.int32)
    mods = make_mods(rng, "all", hq, b)
    dmods = on_device(mods)
    o, lse = cuflash.attention(*(to_device(a) for a in (q, k, v)), kv_lens=to_device(lens), causal=True,
                               return_lse=True, **dmods)
    kc, vc, table = paged_cache(rng, k, v, lens, 16)
    po, plse = cuflash.attention(to_device(q), to_device(kc), to_device(vc), block_table=to_device(table),
                                 kv_lens=to_device(lens), causal=True, return_lse=True, **dmods)
    for bi, n in enumerate(lens):
        seq_mods = dict(mods, alibi_slopes=mods["alibi_slopes"][bi])
        sl = slice(bi, bi + 1)
        for got_o, got_l in ((o, lse), (po, plse)):
            assert_forward_accurate(to_host(got_o)[sl], got_l.get()[sl], q[sl], k[sl, :, :n], v[sl, :, :n],
                                    causal=True, **seq_mods)


def test_prepared_and_vjp(rng):
    q, k, v = random_inputs(rng, (2, 4, 3, 64), (2, 2, 700, 64), BFLOAT16)
    mods = on_device(make_mods(rng, "all", 4, 2))
    dq, dk, dv = (to_device(a) for a in (q, k, v))
    run_ = cuflash.prepare_attention(dq, dk, dv, causal=True, return_lse=True, **mods)
    assert run_.path == "attention"
    o, lse = run_(dq, dk, dv)
    o2, lse2 = cuflash.attention(dq, dk, dv, causal=True, return_lse=True, **mods)
    assert to_host(o).tobytes() == to_host(o2).tobytes() and lse.get().tobytes() == lse2.get().tobytes()
    o3, vjp = cuflash.attention_vjp(dq, dk, dv, causal=True, **mods)
    assert to_host(o3).tobytes() == to_host(o).tobytes()
    assert len(vjp(o3)) == 4


def test_float32_raises(rng):
    q, k, v = (to_device(a) for a in random_inputs(rng, (1, 2, 64, 64), (1, 2, 64, 64), FLOAT32))
    for mods in (dict(softcap=2.0), dict(sinks=cupy.zeros(2, np.float32))):
        with pytest.raises(NotImplementedError, match="float32"):
            cuflash.attention(q, k, v, **mods)


@pytest.mark.parametrize("d", [60, 13])
def test_head_dims_without_16_byte_rows(rng, kernels, d):
    """d % 8 != 0: the inputs are copied into zero-padded rows for the modifier kernels."""
    q, k, v = random_inputs(rng, (2, 2, 90, d), (2, 1, 120, d), FLOAT16)
    do = random_array(rng, q.shape, FLOAT16)
    mods = make_mods(rng, "all", 2, 2)
    o, lse, grads = run(q, k, v, do, mods, causal=True)
    assert_forward_accurate(o, lse, q, k, v, causal=True, **mods)
    assert_backward_accurate(grads, do, q, k, v, causal=True, **mods)


def test_unaligned_rows(rng):
    """Row strides that are not a multiple of 16 bytes (a slice of a wider array)."""
    wide = random_inputs(rng, (1, 2, 70, 76), (1, 2, 80, 76), BFLOAT16)  # rows 152 bytes apart
    q, k, v = (a[..., :64] for a in wide)
    mods = make_mods(rng, "all", 2, 1)
    dq, dk, dv = (to_device(a)[..., :64] for a in wide)
    o, lse = cuflash.attention(dq, dk, dv, return_lse=True, **on_device(mods))
    assert_forward_accurate(to_host(o), lse.get(), np.ascontiguousarray(q), np.ascontiguousarray(k),
                            np.ascontiguousarray(v), **mods)


def test_modifier_arrays_must_be_on_the_device(rng):
    q, k, v = (to_device(a) for a in random_inputs(rng, (1, 2, 8, 64), (1, 2, 8, 64), FLOAT16))
    with pytest.raises(TypeError, match="sinks"):
        cuflash.attention(q, k, v, sinks=np.zeros(2, np.float32))
    with pytest.raises(TypeError, match="alibi_slopes"):
        cuflash.attention(q, k, v, alibi_slopes=np.zeros(2, np.float32))
    if cupy.cuda.runtime.getDeviceCount() > 1:
        with cupy.cuda.Device(1):
            other = cupy.zeros(2, np.float32)
        with pytest.raises(ValueError, match="device"):
            cuflash.attention(q, k, v, sinks=other)
