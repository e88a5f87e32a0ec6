"""cuflash.fp8: e4m3 quantization and its scales, the Hadamard rotation, and the emulated FP8
kernel arithmetic against the float64 reference (cuflash.testing.reference64)."""

import numpy as np
import pytest

from cuflash import fp8
from cuflash.core.arrays import BFLOAT16
from cuflash.testing import reference64, visibility


def test_quantize_per_tensor_scale_error_and_saturation(rng):
    x = (3 * rng.standard_normal((2, 3, 40, 16))).astype(np.float32)
    x8, descale = fp8.quantize(x)
    assert x8.dtype == fp8.E4M3 and descale.shape == () and descale.dtype == np.float32
    assert descale == np.float32(np.abs(x).max() / 448)
    back = fp8.dequantize(x8, descale)
    normal = np.abs(x) >= descale * 2.0**-6  # e4m3's normal range, scaled
    rel = np.abs(back - x)[normal] / np.abs(x)[normal]
    assert rel.max() <= 2.0**-4 * (1 + 1e-6)  # 3 mantissa bits, round to nearest
    assert np.abs(back - x)[~normal].max(initial=0) <= descale * 2.0**-10 * (1 + 1e-6)  # half a subnormal step
    assert np.abs(back).max() == pytest.approx(np.abs(x).max(), rel=2.0**-4)
    big = np.array([[1e6, -1e6]], np.float32)
    assert np.isfinite(fp8.to_e4m3(big).astype(np.float32)).all()  # saturates where a cast gives NaN


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_quantize_per_head(rng, layout):
    shape = (2, 3, 20, 8) if layout == "bhsd" else (2, 20, 3, 8)
    x = rng.standard_normal(shape).astype(BFLOAT16)
    head_axis = 1 if layout == "bhsd" else 2
    x = x * np.arange(1, 4, dtype=np.float32).reshape([-1 if i == head_axis else 1 for i in range(4)])
    x = x.astype(BFLOAT16)
    x8, descale = fp8.quantize(x, granularity="head", layout=layout)
    assert descale.shape == (2, 3)
    xf = x.astype(np.float32)
    for b in range(2):
        for h in range(3):
            part = xf[b, h] if layout == "bhsd" else xf[b, :, h]
            assert descale[b, h] == np.float32(np.abs(part).max() / 448)
    back = fp8.dequantize(x8, descale, layout=layout)
    assert np.abs(back - xf).max() <= 2.0**-4 * np.abs(xf).max()
    zeros = np.zeros((1, 2, 4, 8), np.float16)
    z8, dz = fp8.quantize(zeros, granularity="head")
    assert np.all(dz == 1) and np.all(z8.astype(np.float32) == 0)


def test_quantize_errors_name_the_argument():
    with pytest.raises(TypeError, match="x: expected a NumPy array"):
        fp8.quantize([[1.0]])
    with pytest.raises(TypeError, match="x: expected float16"):
        fp8.quantize(np.zeros((4, 4), np.int32))
    with pytest.raises(ValueError, match="x: has NaN"):
        fp8.quantize(np.array([[np.nan, 1.0]], np.float32))
    with pytest.raises(ValueError, match="granularity"):
        fp8.quantize(np.zeros((4, 4), np.float32), granularity="row")
    with pytest.raises(ValueError, match="descale: expected shape"):
        fp8.dequantize(fp8.to_e4m3(np.zeros((1, 2, 3, 4))), np.ones(3, np.float32))
    with pytest.raises(ValueError, match="d: expected a positive int"):
        fp8.hadamard_rotation(0)


@pytest.mark.parametrize("d", [1, 64, 96, 128, 192])
def test_hadamard_rotation_is_orthogonal_and_keeps_scores(rng, d):
    r = fp8.hadamard_rotation(d, seed=3).astype(np.float64)
    assert np.abs(r @ r.T - np.eye(d)).max() < 1e-6
    q, k = rng.standard_normal((5, d)), rng.standard_normal((7, d))
    assert np.abs((q @ r) @ (k @ r).T - q @ k.T).max() < 1e-5 * d
    if d >= 64:  # an outlier channel is spread over the block: amax falls by sqrt(block)
        x = np.zeros((1, d))
        x[0, 0] = 100.0
        assert np.abs(x @ r).max() == pytest.approx(100.0 / np.sqrt(d & -d), rel=1e-5)


def _quantized_problem(rng, causal_shape=False):
    q = (2 * rng.standard_normal((2, 4, 33, 32))).astype(BFLOAT16)
    k = rng.standard_normal((2, 2, 47, 32)).astype(BFLOAT16)
    v = (0.5 * rng.standard_normal((2, 2, 47, 32))).astype(BFLOAT16)
    return [fp8.quantize(a, granularity="head") for a in (q, k, v)]


@pytest.mark.parametrize("causal", [False, True, "top_left"])
def test_emulation_without_p_rounding_is_the_reference_of_the_dequantized_inputs(rng, causal):
    (q8, dq), (k8, dk), (v8, dv) = _quantized_problem(rng)
    o, lse = fp8.emulate_attention(q8, k8, v8, dq, dk, dv, causal=causal, out_dtype=np.float32,
                                   p_dtype=np.float32)
    deq = [fp8.dequantize(x, d) for x, d in ((q8, dq), (k8, dk), (v8, dv))]
    ref, ref_lse = reference64(*deq, causal=causal)
    # float32 scores, softmax and accumulation: a few float32 roundings of values of size max|o|
    assert np.abs(o - ref).max() <= 64 * 2.0**-24 * np.abs(ref).max() + 1e-30
    assert np.abs(lse - ref_lse).max() <= 64 * 2.0**-24 * (np.abs(ref_lse).max() + 1)


@pytest.mark.parametrize("causal, window", [(False, (5, 3)), ("bottom_right", (0, 0)), ("top_left", (-1, 2)),
                                            (False, (40, -1))])
def test_emulation_with_a_window_or_a_mask(rng, causal, window):
    # window= is cuflash.attention's; mask= the same visibility given explicitly (rows that see no
    # key: o = 0, lse = -inf), at the kernel's rounding points too.
    (q8, dq), (k8, dk), (v8, dv) = _quantized_problem(rng)
    o, lse = fp8.emulate_attention(q8, k8, v8, dq, dk, dv, causal=causal, window=window, out_dtype=np.float32,
                                   p_dtype=np.float32)
    deq = [fp8.dequantize(x, d) for x, d in ((q8, dq), (k8, dk), (v8, dv))]
    ref, ref_lse = reference64(*deq, causal=causal, window=window)
    seen = np.isfinite(ref_lse)
    assert np.abs(o - ref).max() <= 64 * 2.0**-24 * np.abs(ref).max() + 1e-30
    assert np.abs(lse[seen] - ref_lse[seen]).max() <= 64 * 2.0**-24 * (np.abs(ref_lse[seen]).max() + 1)
    assert np.array_equal(lse[~seen], ref_lse[~seen])
    vis = visibility(causal, 33, 47, window)
    for block_n in (None, 16):
        a = fp8.emulate_attention(q8, k8, v8, dq, dk, dv, causal=causal, window=window, block_n=block_n)
        b = fp8.emulate_attention(q8, k8, v8, dq, dk, dv, mask=vis, block_n=block_n)
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match=r"^mask: expected a \(33, 47\) boolean array"):
        fp8.emulate_attention(q8, k8, v8, dq, dk, dv, mask=vis[:, :5])
    with pytest.raises(ValueError, match="^mask: expected"):
        fp8.emulate_attention(q8, k8, v8, dq, dk, dv, mask=vis, causal=True)


def test_emulation_rounds_p_to_e4m3_within_its_bound(rng):
    (q8, dq), (k8, dk), (v8, dv) = _quantized_problem(rng)
    deq = [fp8.dequantize(x, d) for x, d in ((q8, dq), (k8, dk), (v8, dv))]
    ref = reference64(*deq)[0]
    exact_p = fp8.emulate_attention(q8, k8, v8, dq, dk, dv, out_dtype=np.float32, p_dtype=np.float32)[0]
    p8 = fp8.emulate_attention(q8, k8, v8, dq, dk, dv, out_dtype=np.float32)[0]
    err = np.abs(p8 - ref).max()
    # each P_ij moves by at most 2^-4 P_ij (normal range) or 2^-10 (subnormal): o by at most
    # max|v| (2^-4 + N_k 2^-10); the rounding must show (it is the FP8 kernel's P V operand)
    vmax = np.abs(deq[2]).max()
    assert err <= vmax * (2.0**-4 + 47 * 2.0**-10)
    assert err > 10 * np.abs(exact_p - ref).max()
    o_bshd = fp8.emulate_attention(*(np.swapaxes(x, 1, 2) for x in (q8, k8, v8)), dq, dk, dv, layout="bshd",
                                   out_dtype=np.float32)[0]
    assert np.array_equal(np.swapaxes(o_bshd, 1, 2), p8)


def test_emulation_errors_name_the_argument(rng):
    (q8, dq), (k8, dk), (v8, dv) = _quantized_problem(rng)
    with pytest.raises(TypeError, match="q8: expected float8_e4m3fn"):
        fp8.emulate_attention(q8.view(np.int8), k8, v8, dq, dk, dv)
    with pytest.raises(ValueError, match="k_descale: expected shape"):
        fp8.emulate_attention(q8, k8, v8, dq, dq, dv)
    with pytest.raises(ValueError, match="k8, v8"):
        fp8.emulate_attention(q8, k8[:, :, :5], v8, dq, dk, dv)
