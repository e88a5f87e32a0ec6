"""cuflash.merge_attention_states on the GPU (cuda_src/merge.cu), attention(out_dtype=float32) on
the GPU, and the backward of a key slice with the global o and lse on every GPU backward family
(16-bit mma.sync and Hopper, float32 float64-tensor-core and FMA kernels): against the float64
reference by the accuracy rule, as tests/test_merge.py on the CPU. Outputs are poisoned first."""

from __future__ import annotations

import numpy as np
import pytest
from _merge_cases import check_merge_equals_full, check_slice_backward

import cuflash
from cuflash.core.arrays import BFLOAT16
from cuflash.testing import (assert_within_rule, faithful_realizations, poisoned_allocations, random_array,
                             random_inputs, reference64, to_numpy)

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

DTYPES = [pytest.param(np.float16, id="f16"), pytest.param(BFLOAT16, id="bf16"), pytest.param(np.float32, id="f32")]


_UINT = {2: np.uint16, 4: np.uint32}


def _gpu(*arrays):
    """Device copies; through the bits (CuPy's bfloat16 is storage only)."""
    return tuple(cupy.asarray(np.ascontiguousarray(a).view(_UINT[a.dtype.itemsize])).view(a.dtype) for a in arrays)


def _poisoned(shape, dtype):
    a = cupy.empty(shape, dtype=dtype)
    a.view(_UINT[a.dtype.itemsize]).fill({2: 0x7FFF, 4: 0x7FFFFFFF}[a.dtype.itemsize])  # NaN in every float dtype
    return a


def _shapes(layout, b, hq, hkv, nq, nk, d):
    return ((b, hq, nq, d), (b, hkv, nk, d)) if layout == "bhsd" else ((b, nq, hq, d), (b, nk, hkv, d))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_merge_of_key_slices_equals_full_attention(rng, dtype, layout, causal, d):
    # 16 queries, 300 keys: the slices before the last are seen whole by every query (the float32
    # GPU kernels take no window); the last one is causal. GQA 4:2.
    sq, skv = _shapes(layout, 2, 4, 2, 16, 300, d)
    q, k, v = _gpu(*random_inputs(rng, sq, skv, dtype))
    poisoned_allocations(lambda: check_merge_equals_full(q, k, v, [0, 100, 285, 300], causal=causal, layout=layout,
                                                         xp=cupy))


@pytest.mark.parametrize("parts_dtype", [np.float16, BFLOAT16, np.float32])
@pytest.mark.parametrize("out_dtype", [np.float16, BFLOAT16, np.float32])
def test_merge_kernel_against_the_cpu_and_empty_rows(rng, parts_dtype, out_dtype):
    o = random_array(rng, (3, 2, 5, 4, 40), parts_dtype)  # bshd parts: strided heads
    lse = (3 * rng.standard_normal((3, 2, 4, 5))).astype(np.float32)
    lse[:, 0, 1, 2] = -np.inf  # no part saw row (0, head 1, 2)
    o[:, 0, 2, 1] = np.nan
    lse[1, 1, 3, 4] = -np.inf  # part 1 saw nothing of this row; its NaN must not leak
    o[1, 1, 4, 3] = np.nan
    og, lg = _gpu(o, lse)
    out = _poisoned((2, 5, 4, 40), out_dtype)
    lse_out = _poisoned((2, 4, 5), np.float32)
    ro, rl = cuflash.merge_attention_states(og, lg, layout="bshd", dtype=out_dtype, out=out, lse_out=lse_out)
    assert ro is out and rl is lse_out
    want_o, want_lse = cuflash.merge_attention_states(o, lse, layout="bshd", dtype=out_dtype)
    got_o, got_lse = to_numpy(ro).astype(np.float64), to_numpy(rl)
    assert np.all(got_o[0, 2, 1] == 0) and got_lse[0, 1, 2] == -np.inf
    assert np.isfinite(got_o).all() and np.isfinite(np.delete(got_lse.reshape(-1), 1 * 5 + 2)).all()
    # the same formula in the same arithmetic type; exp/log of the GPU and of NumPy differ by an ulp
    u = {np.dtype(np.float16): 2**-11, np.dtype(BFLOAT16): 2**-8, np.dtype(np.float32): 2**-24}[np.dtype(out_dtype)]
    np.testing.assert_allclose(got_o, want_o.astype(np.float64), rtol=2 * u, atol=2 * u * np.abs(want_o).max())
    np.testing.assert_allclose(got_lse, want_lse, rtol=2**-21, atol=2**-21)
    # inputs untouched
    assert np.array_equal(to_numpy(lg), lse) and np.array_equal(to_numpy(og).view(np.uint8), o.view(np.uint8))


def test_merge_two_dimensional_and_sequence_of_parts(rng):
    q, k, v = _gpu(*random_inputs(rng, (40, 32), (90, 32), BFLOAT16))
    parts = [cuflash.attention(q, k[a:b], v[a:b], return_lse=True, out_dtype=np.float32) for a, b in ((0, 30), (30, 90))]
    o, lse = cuflash.merge_attention_states([p[0] for p in parts], [p[1] for p in parts], dtype=BFLOAT16)
    qn, kn, vn = (to_numpy(a) for a in (q, k, v))
    ref, ref_lse = reference64(qn, kn, vn)
    assert_within_rule("o", to_numpy(o), ref, faithful_realizations(qn, kn, vn), BFLOAT16)


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16])
def test_out_dtype_float32_on_the_gpu(rng, dtype):
    q, k, v = random_inputs(rng, (2, 4, 100, 64), (2, 2, 130, 64), dtype)
    o32, lse = cuflash.attention(*_gpu(q, k, v), causal=True, return_lse=True, out_dtype=np.float32)
    assert o32.dtype == np.float32
    ref, _ = reference64(q, k, v, causal=True)
    assert_within_rule("o", to_numpy(o32), ref, faithful_realizations(q, k, v, causal=True), dtype)
    o16 = cuflash.attention(*_gpu(q, k, v), causal=True)
    # float32 o is not rounded to 16 bits: closer to the reference than the 16-bit result
    assert np.abs(to_numpy(o32) - ref).max() < np.abs(to_numpy(o16).astype(np.float64) - ref).max()


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward_of_a_key_slice_16bit(rng, kernels, dtype, layout, causal, d):
    # Square causal problem, uneven slices: the middle slices take the window (band backward).
    sq, skv = _shapes(layout, 2, 4, 2, 150, 150, d)
    q, k, v, do = _gpu(*random_inputs(rng, sq, skv, dtype), random_array(rng, sq, dtype))
    check_slice_backward(do, q, k, v, [0, 40, 100, 150], causal=causal, layout=layout)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 192])  # d <= 128: float64 tensor cores on sm_90; 192: FMA kernels
def test_backward_of_a_key_slice_float32(rng, layout, causal, d):
    # The float32 GPU backward honours a given lse over more keys than it holds; the float32
    # kernels take no window, so the query rows see every slice but the last whole.
    sq, skv = _shapes(layout, 2, 4, 2, 24, 200, d)
    q, k, v, do = _gpu(*random_inputs(rng, sq, skv, np.float32), random_array(rng, sq, np.float32))
    check_slice_backward(do, q, k, v, [0, 70, 177, 200], causal=causal, layout=layout)


def test_float32_backward_of_the_whole_key_set_unchanged(rng):
    # the given lse is this call's own: the exact float64 statistics replace it (a lse one ulp off
    # gives the same gradients bit for bit)
    q, k, v, do = _gpu(*random_inputs(rng, (1, 2, 70, 64), (1, 2, 90, 64), np.float32, 4.0),
                       random_array(rng, (1, 2, 70, 64), np.float32))
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    g1 = cuflash.attention_backward(do, q, k, v, o, lse)
    g2 = cuflash.attention_backward(do, q, k, v, o, cupy.nextafter(lse, cupy.float32(np.inf)))
    for a, b in zip(g1, g2):
        assert cupy.array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, "bottom_right", "top_left"])
@pytest.mark.parametrize("nq,nk", [(200, 333), (3, 700)])
def test_out_dtype_float32_epilogue_of_the_mma_sync_kernel(rng, dtype, d, causal, nq, nk):
    # attn_fwd_o32 stores the accumulator that attn_fwd rounds to 16 bits: on the same tile, o32
    # rounded to the input dtype is attn_fwd's o bit for bit, and lse is the same.
    from cuflash.backends import cuda as cuda_backend
    from cuflash.core import problem
    from cuflash.core.layout import to_bhsd
    from cuflash.plan.forward import forward_spec

    q, k, v = random_inputs(rng, (2, 4, nq, d), (2, 2, nk, d), dtype)
    qg, kg, vg = _gpu(q, k, v)
    out = _poisoned(q.shape, np.float32)
    o32, lse = cuflash.attention(qg, kg, vg, causal=causal, return_lse=True, out_dtype=np.float32, out=out)
    assert o32 is out
    ref, _ = reference64(q, k, v, causal=causal)
    assert_within_rule("o", to_numpy(o32), ref, faithful_realizations(q, k, v, causal=causal), dtype)
    p = problem.validate_forward(qg, kg, vg, causal=causal)
    _, tile = forward_spec(dtype, d, p.causal is not None, True)
    o16, lse16 = _poisoned(q.shape, dtype), _poisoned((2, 4, nq), np.float32)
    cuda_backend.forward(p, *(to_bhsd(a, p, h, n) for a, h, n in ((qg, 4, nq), (kg, 2, nk), (vg, 2, nk))),
                         to_bhsd(o16, p, 4, nq), lse16, tile=tile)
    assert np.array_equal(to_numpy(o32).astype(dtype).view(np.uint16), to_numpy(o16).view(np.uint16))
    assert np.array_equal(to_numpy(lse), to_numpy(lse16))


def test_out_dtype_float32_where_the_epilogue_does_not_apply(rng):
    # d = 36 (not a multiple of 8) and kv_lens: the inputs are widened and the float32 kernels run
    q, k, v = random_inputs(rng, (2, 3, 50, 36), (2, 3, 80, 36), BFLOAT16)
    o32 = cuflash.attention(*_gpu(q, k, v), causal=True, out_dtype=np.float32)
    ref, _ = reference64(q, k, v, causal=True)
    assert_within_rule("o", to_numpy(o32), ref, faithful_realizations(q, k, v, causal=True), BFLOAT16)
    q, k, v = random_inputs(rng, (2, 3, 50, 64), (2, 3, 80, 64), np.float16)
    lens = np.array([80, 31], dtype=np.int32)
    o32 = to_numpy(cuflash.attention(*_gpu(q, k, v), kv_lens=cupy.asarray(lens), out_dtype=np.float32))
    o_cpu = cuflash.attention(q, k, v, kv_lens=lens, out_dtype=np.float32)
    for b, n in enumerate(lens):
        ref, _ = reference64(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n])
        assert_within_rule("o", o32[b:b + 1], ref, faithful_realizations(q[b:b + 1], k[b:b + 1, :, :n],
                                                                          v[b:b + 1, :, :n]), np.float16)
    assert o_cpu.dtype == o32.dtype == np.float32
