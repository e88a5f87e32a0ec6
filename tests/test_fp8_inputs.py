"""cuflash.attention with float8_e4m3fn inputs and descale factors (the NumPy backend): o against
the float64 oracle of the dequantized inputs by the accuracy rule, the default bfloat16 o as one
rounding of the float32 result, every option passed through, and the errors naming the argument."""

import numpy as np
import pytest

import cuflash
from cuflash import fp8
from cuflash.core.arrays import BFLOAT16
from cuflash.testing import assert_forward_accurate, random_inputs

E4M3 = fp8.E4M3


def _dequantized(x8, descale, layout, per_kv_head_group=1):
    """The test's own dequantization, in float64 then rounded to float32 (the product of a 4-bit
    and a 24-bit significand is exact in float64): the values an FP8 input stands for."""
    x = x8.astype(np.float64)
    d = np.asarray(descale, dtype=np.float64)
    if d.ndim == 0 or d.shape == (1,):
        return (x * d.reshape(())).astype(np.float32)
    if per_kv_head_group > 1:
        d = np.repeat(d, per_kv_head_group, axis=-1)
    if layout == "bhsd":
        d = d[..., :, None, None]
    else:
        d = d[..., None, :, None]
    return (x * d).astype(np.float32)


def _fp8_inputs(rng, shape_q, shape_kv, granularity, layout):
    q, k, v = random_inputs(rng, shape_q, shape_kv, np.float32)
    return [fp8.quantize(a, granularity=granularity, layout=layout) for a in (q, k, v)]


@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_o_is_the_attention_of_the_dequantized_inputs(rng, granularity, layout, causal):
    b, hq, hkv, nq, nk, d = 2, 4, 2, 70, 90, 64
    sq = (b, hq, nq, d) if layout == "bhsd" else (b, nq, hq, d)
    skv = (b, hkv, nk, d) if layout == "bhsd" else (b, nk, hkv, d)
    (q8, qd), (k8, kd), (v8, vd) = _fp8_inputs(rng, sq, skv, granularity, layout)
    before = [a.tobytes() for a in (q8, k8, v8, qd, kd, vd)]
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=causal, layout=layout)
    o32, lse = cuflash.attention(q8, k8, v8, out_dtype=np.float32, return_lse=True, **kw)
    wide = [_dequantized(x8, dd, layout) for x8, dd in ((q8, qd), (k8, kd), (v8, vd))]
    assert_forward_accurate(o32, lse, *wide, causal=causal, layout=layout)
    # the default output: bfloat16, one rounding of that float32 result; float16 alike
    o = cuflash.attention(q8, k8, v8, **kw)
    assert o.dtype == BFLOAT16 and o.tobytes() == o32.astype(BFLOAT16).tobytes()
    o16 = cuflash.attention(q8, k8, v8, out_dtype=np.float16, **kw)
    assert o16.tobytes() == o32.astype(np.float16).tobytes()
    assert [a.tobytes() for a in (q8, k8, v8, qd, kd, vd)] == before, "an input was modified"


def test_q_descale_per_kv_head_as_flashattention3_takes_it(rng):
    b, hq, hkv, n, d = 2, 6, 2, 40, 32
    q, k, v = random_inputs(rng, (b, hq, n, d), (b, hkv, n, d), np.float32)
    q8, k8, v8 = (fp8.to_e4m3(a * 50) for a in (q, k, v))
    qd = rng.uniform(0.001, 0.02, (b, hkv)).astype(np.float32)  # one per K/V head's group of 3
    kd = rng.uniform(0.001, 0.02, (b, hkv)).astype(np.float32)
    vd = np.float32(0.01).reshape(1)
    o, lse = cuflash.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=np.float32,
                               return_lse=True)
    wide = (_dequantized(q8, qd, "bhsd", per_kv_head_group=3), _dequantized(k8, kd, "bhsd"),
            _dequantized(v8, vd, "bhsd"))
    assert_forward_accurate(o, lse, *wide)
    # descales per query head give the same result when each group's are equal
    same = cuflash.attention(q8, k8, v8, q_descale=np.repeat(qd, 3, axis=1), k_descale=kd, v_descale=vd,
                             out_dtype=np.float32)
    assert same.tobytes() == o.tobytes()


def test_every_option_passes_through(rng):
    """The FP8 path dequantizes, then runs the float32 path with the same options: the results
    equal the float32 call on the dequantized inputs bit for bit."""
    b, hq, hkv, nq, nk, d = 3, 4, 2, 20, 48, 64
    (q8, qd), (k8, kd), (v8, vd) = _fp8_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), "tensor", "bhsd")
    wide = [_dequantized(x8, dd, "bhsd") for x8, dd in ((q8, qd), (k8, kd), (v8, vd))]
    fp8_kw = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    lens = np.array([48, 5, 30], np.int32)
    options = [dict(causal=True, window=(10, 0)), dict(kv_lens=lens, causal=True),
               dict(softcap=5.0, alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4], np.float32),
                    sinks=np.array([0.0, 1.0, -1.0, 2.0], np.float32), causal="top_left")]
    for kw in options:
        got, got_lse = cuflash.attention(q8, k8, v8, return_lse=True, **fp8_kw, **kw)
        want, want_lse = cuflash.attention(*wide, return_lse=True, **kw)
        assert got.tobytes() == want.astype(BFLOAT16).tobytes(), kw
        assert got_lse.tobytes() == want_lse.tobytes(), kw
    # packed sequences (per-tensor descales)
    cq, ck = np.array([0, 7, 20], np.int32), np.array([0, 30, 48], np.int32)
    pq8, pk8, pv8 = (a[0].transpose(1, 0, 2) for a in (q8, k8, v8))  # (total, H, d)
    pw = [a[0].transpose(1, 0, 2) for a in wide]
    got = cuflash.attention(pq8, pk8, pv8, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True, **fp8_kw)
    want = cuflash.attention(*pw, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True)
    assert got.tobytes() == want.astype(BFLOAT16).tobytes()
    # out= of the output dtype
    out = np.full((b, hq, nq, d), np.nan, BFLOAT16)
    res = cuflash.attention(q8, k8, v8, out=out, **fp8_kw)
    assert res is out and out.tobytes() == cuflash.attention(*wide).astype(BFLOAT16).tobytes()


def test_a_paged_cache_takes_per_tensor_descales(rng):
    b, hq, hkv, nk, d, bs = 2, 4, 2, 64, 64, 16
    (q8, qd), (k8, kd), (v8, vd) = _fp8_inputs(rng, (b, hq, 1, d), (b, hkv, nk, d), "tensor", "bhsd")
    # pages: sequence s's block j is page 4 s + j (a contiguous cache cut into pages)
    pages = lambda x: x.transpose(0, 2, 1, 3).reshape(b * nk // bs, bs, hkv, d)  # noqa: E731
    table = np.arange(b * nk // bs, dtype=np.int32).reshape(b, nk // bs)
    got = cuflash.attention(q8, pages(k8), pages(v8), block_table=table, q_descale=qd, k_descale=kd, v_descale=vd)
    wide = [_dequantized(x8, dd, "bhsd") for x8, dd in ((q8, qd), (k8, kd), (v8, vd))]
    assert got.tobytes() == cuflash.attention(*wide).astype(BFLOAT16).tobytes()
    with pytest.raises(ValueError, match="k_descale: expected shape \\(\\)"):
        cuflash.attention(q8, pages(k8), pages(v8), block_table=table, k_descale=np.ones((b, hkv), np.float32))


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16])
def test_an_fp8_kv_cache_with_a_16_bit_q(rng, dtype):
    b, hq, hkv, nk, d = 2, 8, 2, 300, 128
    q = random_inputs(rng, (b, hq, 1, d), (b, hkv, nk, d), dtype)[0]
    (k8, kd), (v8, vd) = _fp8_inputs(rng, (b, hkv, nk, d), (b, hkv, nk, d), "head", "bhsd")[:2]
    o, lse = cuflash.attention(q, k8, v8, k_descale=kd, v_descale=vd, return_lse=True)
    assert o.dtype == dtype  # q's dtype by default
    wide = (q, _dequantized(k8, kd, "bhsd"), _dequantized(v8, vd, "bhsd"))
    o32 = cuflash.attention(q, k8, v8, k_descale=kd, v_descale=vd, out_dtype=np.float32)
    assert_forward_accurate(o32, lse, *(a.astype(np.float32) for a in wide))
    assert o.tobytes() == o32.astype(dtype).tobytes()
    with pytest.raises(TypeError, match="q_descale: a .* q takes no descale"):
        cuflash.attention(q, k8, v8, q_descale=np.float32(1).reshape(()))
    with pytest.raises(TypeError, match=r"v: expected float8_e4m3fn \(k is float8_e4m3fn\)"):
        cuflash.attention(q, k8, q)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_the_materializing_reference_takes_the_same_arguments(rng, layout):
    from cuflash.backends import reference

    sq, skv = ((2, 6, 30, 32), (2, 2, 40, 32)) if layout == "bhsd" else ((2, 30, 6, 32), (2, 40, 2, 32))
    (q8, qd), (k8, kd), (v8, vd) = _fp8_inputs(rng, sq, skv, "head", layout)
    qd_kv = rng.uniform(0.001, 0.01, (2, 2)).astype(np.float32)  # q per K/V head
    kw = dict(causal=True, layout=layout)
    for q_descale, group in ((qd, 1), (qd_kv, 3)):
        o, lse = reference.attention(q8, k8, v8, q_descale=q_descale, k_descale=kd, v_descale=vd, precision="float64",
                                     return_lse=True, **kw)
        wide = (_dequantized(q8, q_descale, layout, per_kv_head_group=group), _dequantized(k8, kd, layout),
                _dequantized(v8, vd, layout))
        o_ref, lse_ref = reference.attention(*wide, precision="float64", return_lse=True, **kw)
        assert o.tobytes() == o_ref.tobytes() and lse.tobytes() == lse_ref.tobytes()
        # float32 precision: o in the FP8 output dtype
        o16 = reference.attention(q8, k8, v8, q_descale=q_descale, k_descale=kd, v_descale=vd, **kw)
        assert o16.dtype == BFLOAT16 and o16.shape == o_ref.shape
    with pytest.raises(TypeError, match="k_descale: expected dtype float32"):
        reference.attention(q8, k8, v8, k_descale=kd.astype(np.float64), **kw)


def test_errors_name_the_argument(rng):
    (q8, qd), (k8, kd), (v8, vd) = _fp8_inputs(rng, (1, 2, 8, 32), (1, 2, 8, 32), "head", "bhsd")
    bf = np.zeros((1, 2, 8, 32), BFLOAT16)
    with pytest.raises(TypeError, match="k: expected float8_e4m3fn \\(q, v are float8_e4m3fn\\), got bfloat16"):
        cuflash.attention(q8, bf, v8)
    with pytest.raises(TypeError, match="q: expected float8_e4m3fn \\(a descale factor was given\\)"):
        cuflash.attention(bf, bf, bf, k_descale=kd)
    with pytest.raises(TypeError, match="k_descale: expected dtype float32, got float64"):
        cuflash.attention(q8, k8, v8, k_descale=kd.astype(np.float64))
    with pytest.raises(TypeError, match="v_descale: expected a float32 NumPy array"):
        cuflash.attention(q8, k8, v8, v_descale=0.5)
    with pytest.raises(ValueError, match="q_descale: expected shape"):
        cuflash.attention(q8, k8, v8, q_descale=np.ones((2, 1), np.float32))
    with pytest.raises(ValueError, match="v_descale: has NaN"):
        cuflash.attention(q8, k8, v8, v_descale=np.array(np.nan, np.float32))
    with pytest.raises(ValueError, match="out_dtype: with float8_e4m3fn inputs"):
        cuflash.attention(q8, k8, v8, out_dtype=np.int32)
    with pytest.raises(TypeError, match="out: expected dtype bfloat16, got float16"):
        cuflash.attention(q8, k8, v8, out=np.empty((1, 2, 8, 32), np.float16))
    with pytest.raises(ValueError, match="k_descale: expected shape \\(\\)"):  # packed: per tensor only
        cuflash.attention(q8[0].transpose(1, 0, 2), k8[0].transpose(1, 0, 2), v8[0].transpose(1, 0, 2),
                          cu_seqlens_q=np.array([0, 8], np.int32), cu_seqlens_k=np.array([0, 8], np.int32),
                          k_descale=kd)
    with pytest.raises(ValueError, match="layout"):
        cuflash.attention(q8, k8, v8, layout="sbhd")
    with pytest.raises(ValueError, match="q_descale: expected shape"):  # 3 query heads over 2 K/V heads
        cuflash.attention(fp8.to_e4m3(np.ones((1, 3, 8, 32))), k8, v8, q_descale=np.ones((1, 2), np.float32))
    with pytest.raises(ValueError, match="k: number of heads 2 must divide"):
        cuflash.attention(fp8.to_e4m3(np.ones((1, 3, 8, 32))), k8, v8)
    # the backward takes no FP8 inputs (FP8 is a forward format here): its dtype check names q
    o = cuflash.attention(q8, k8, v8)
    with pytest.raises(TypeError, match="q"):
        cuflash.attention_backward(o, q8, k8, v8, o, np.zeros((1, 2, 8), np.float32))
