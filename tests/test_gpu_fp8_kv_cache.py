"""An e4m3 (FP8) K/V cache in the split-KV decode kernel (attn_decode_kv8) against the float64
reference of the dequantized cache, by the accuracy rule.

With power-of-two descales the dequantized values k8 * descale are exact in float16 and bfloat16,
so the project's yardstick runs on them in q's dtype: the kernel promises the same arithmetic
(float32 scores and softmax, P rounded to 16 bits, o rounded once). Descales differ per (sequence,
K/V head), so a kernel that drops one or reads another head's fails. The codes are drawn from all
finite e4m3 values (subnormals and +-448 included); pages nobody uses hold e4m3 NaN. A last test
takes arbitrary descales against a yardstick written here: float32 q k8 times k_descale, the softmax
in float32, P rounded at four points of the binade, o = P v8 v_descale / l rounded once."""

import numpy as np
import pytest

import cuflash
from cuflash import fp8
from cuflash.core.arrays import BFLOAT16, FLOAT16
from cuflash.core.fp8_inputs import E4M3
from cuflash.kernels import decode as decode_kernels
from cuflash.plan import decode as plan_decode
from cuflash.testing import FACTOR, assert_within_rule, poison, poisoned_allocations, reference64

from _kvlens_check import check_per_sequence
from test_paged import paged_cache

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

_FINITE_CODES = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)  # (0x7F, 0xFF: NaN)


def _codes(rng, shape):
    """e4m3 values drawn uniformly from the finite codes (each binade, subnormals, +-0, +-448)."""
    return rng.choice(_FINITE_CODES, size=shape).view(E4M3)


def _descales(rng, b, hkv, per_head):
    """Power-of-two float32 descales: per (sequence, K/V head) or one per tensor (shape ())."""
    shape = (b, hkv) if per_head else ()
    return [np.ldexp(np.float32(1), rng.integers(-9, -5, size=shape)).astype(np.float32) for _ in "kv"]


def _dequantized16(x8, descale, dtype):
    """(B, Hkv, N, d) x8 * descale in q's dtype (exact for power-of-two descales; asserted)."""
    d = np.asarray(descale, dtype=np.float32)
    if d.ndim:
        d = d[:, :, None, None]
    x = x8.astype(np.float32) * d
    assert (x.astype(dtype).astype(np.float32) == x).all(), "the test's descales must keep the values exact"
    return x.astype(dtype)


def _device(x8):
    """The e4m3 values' bits as a CuPy uint8 array (the form CuPy can hold; descales mark them)."""
    return cupy.asarray(x8.view(np.uint8))


def _run(q, k8, v8, kd, vd, **kw):
    args = [cupy.asarray(q), _device(k8), _device(v8), cupy.asarray(kd), cupy.asarray(vd)]
    before = [a.reshape(-1).view(np.uint8).copy() for a in args]  # (0-d descales: viewed as 1-d)
    out = poison(cupy.empty(q.shape, dtype=q.dtype))
    o, lse = poisoned_allocations(lambda: cuflash.attention(
        args[0], args[1], args[2], k_descale=args[3], v_descale=args[4], return_lse=True, out=out, **kw))
    for a, a0 in zip(args, before):
        assert bool((a.reshape(-1).view(np.uint8) == a0).all()), "an input was modified"
    return o.get(), lse.get()


@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16], ids=["f16", "bf16"])
@pytest.mark.parametrize("causal", [False, "bottom_right"], ids=["full", "br"])
@pytest.mark.parametrize("hq,hkv,d,nq", [(32, 8, 128, 1), (32, 8, 128, 5), (8, 1, 64, 1), (8, 1, 64, 5),
                                          (4, 4, 256, 1), (4, 4, 256, 5), (16, 2, 96, 5), (64, 1, 128, 1)])
@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "per-tensor"])
def test_fp8_cache_decode(rng, dtype, causal, nq, hq, hkv, d, per_head):
    b, nk = 4, 1500
    q = rng.standard_normal((b, hq, nq, d)).astype(dtype)
    k8, v8 = _codes(rng, (b, hkv, nk, d)), _codes(rng, (b, hkv, nk, d))
    kd, vd = _descales(rng, b, hkv, per_head)
    lens = np.array([0, 1, int(rng.integers(2, nk)), nk], dtype=np.int32)
    o, lse = _run(q, k8, v8, kd, vd, causal=causal, kv_lens=cupy.asarray(lens))
    check_per_sequence(o, lse, q, _dequantized16(k8, kd, dtype), _dequantized16(v8, vd, dtype), lens, causal, dtype)


@pytest.mark.parametrize("splits,cluster,merge", [(1, None, None), (2, True, None), (4, True, None),
                                                  (3, False, "last"), (7, False, "kernel"), (40, False, "last"),
                                                  (40, False, "kernel")])
def test_fp8_cache_split_merges(rng, splits, cluster, merge):
    """Every way the splits merge: one split, the cluster, the last split, the combine kernel."""
    from cuflash.core.problem import validate_forward

    b, hq, hkv, nq, nk, d = 2, 8, 2, 1, 4000, 128
    q = rng.standard_normal((b, hq, nq, d)).astype(BFLOAT16)
    k8, v8 = _codes(rng, (b, hkv, nk, d)), _codes(rng, (b, hkv, nk, d))
    kd, vd = _descales(rng, b, hkv, True)
    qg, kg, vg = cupy.asarray(q), _device(k8), _device(v8)
    stand = cupy.zeros((b, hkv, nk, d), dtype=BFLOAT16)
    p = validate_forward(qg, stand, stand, causal=True)
    o4 = poison(cupy.empty(qg.shape, dtype=qg.dtype))
    lse3 = cupy.full((b, hq, nq), np.nan, dtype=np.float32)
    descales = (cupy.asarray(kd), cupy.asarray(vd), hkv, 1)
    poisoned_allocations(lambda: decode_kernels.forward(p, qg, kg, vg, o4, lse3, splits=splits, cluster=cluster,
                                                        merge=merge, kv_descales=descales))
    check_per_sequence(o4.get(), lse3.get(), q, _dequantized16(k8, kd, BFLOAT16), _dequantized16(v8, vd, BFLOAT16),
                       [nk] * b, True, BFLOAT16)


@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("window", [None, (100, 0)])
def test_fp8_cache_paged(rng, bs, window):
    """Pages read in place; unused pages hold e4m3 NaN, so reading one shows."""
    b, hq, hkv, nq, nk, d = 5, 16, 4, 2, 1300, 128
    q = rng.standard_normal((b, hq, nq, d)).astype(BFLOAT16)
    k8, v8 = _codes(rng, (b, hkv, nk, d)), _codes(rng, (b, hkv, nk, d))
    kd, vd = (x.reshape(()) for x in _descales(rng, 1, 1, False))  # (a paged cache: per tensor)
    lens = np.array([0, 1, 257, 1300, 999], dtype=np.int32)
    # (the codes as float32 through paged_cache, whose unused pages are NaN: here the e4m3 NaN code)
    kc, vc, table = paged_cache(rng, k8.view(np.uint8).astype(np.float32), v8.view(np.uint8).astype(np.float32),
                                lens, bs)
    kc, vc = (np.where(np.isnan(c), 0x7F, c).astype(np.uint8).view(E4M3) for c in (kc, vc))
    args = dict(block_table=cupy.asarray(table), kv_lens=cupy.asarray(lens), causal="bottom_right", window=window)
    o, lse = _run(q, kc, vc, kd, vd, **args)
    check_per_sequence(o, lse, q, _dequantized16(k8, kd, BFLOAT16), _dequantized16(v8, vd, BFLOAT16), lens,
                       "bottom_right", BFLOAT16, window=window)


def test_fp8_cache_layout_bshd(rng):
    b, hq, hkv, nq, nk, d = 3, 8, 2, 3, 700, 64
    q = rng.standard_normal((b, nq, hq, d)).astype(FLOAT16)
    k8, v8 = _codes(rng, (b, nk, hkv, d)), _codes(rng, (b, nk, hkv, d))
    kd, vd = _descales(rng, b, hkv, True)
    o, lse = _run(q, k8, v8, kd, vd, layout="bshd")
    t = (0, 2, 1, 3)
    check_per_sequence(o.transpose(t), lse, q.transpose(t), _dequantized16(k8.transpose(t), kd, FLOAT16),
                       _dequantized16(v8.transpose(t), vd, FLOAT16), [nk] * b, False, FLOAT16)


def _yardstick(q, k8, v8, kd, vd, causal, realization):
    """The promised arithmetic in float32 (see the module docstring), o in q's dtype."""
    f32 = np.float32
    group = q.shape[1] // k8.shape[1]
    k = np.repeat(k8.astype(f32), group, axis=1)
    v = np.repeat(v8.astype(f32), group, axis=1)
    kdh, vdh = (np.repeat(x, group, axis=1)[:, :, None, None] for x in (kd, vd))
    s = np.matmul(q.astype(f32), k.swapaxes(-1, -2)) * kdh * f32(1 / np.sqrt(q.shape[-1]))
    nq, nk = s.shape[-2:]
    if causal:
        s = np.where(np.arange(nk)[None, :] <= np.arange(nq)[:, None] + nk - nq, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    c = np.random.default_rng(realization).uniform(1, 2, size=m.shape).astype(f32) if realization else f32(1)
    p16 = (e * c).astype(np.float16).astype(f32) / c
    return (np.matmul(p16, v) * vdh / l).astype(q.dtype)


@pytest.mark.parametrize("causal", [False, "bottom_right"], ids=["full", "br"])
def test_fp8_cache_arbitrary_descales(rng, causal):
    """Descales that are not powers of two: against the float64 reference of the float32
    dequantized values, bound by the yardstick above (the project's rule, FACTOR of it)."""
    b, hq, hkv, nq, nk, d = 2, 8, 2, 4, 3000, 128
    q = rng.standard_normal((b, hq, nq, d)).astype(BFLOAT16)
    k8 = fp8.to_e4m3(rng.standard_normal((b, hkv, nk, d)) * 30)
    kd = rng.uniform(0.003, 0.03, (b, hkv)).astype(np.float32)
    v8, vd = fp8.quantize(rng.standard_normal((b, hkv, nk, d)).astype(np.float32), granularity="head")
    o, _ = _run(q, k8, v8, kd, vd, causal=causal)
    kw = k8.astype(np.float32) * kd[:, :, None, None]
    vw = v8.astype(np.float32) * vd[:, :, None, None]
    ref, _ = reference64(q.astype(np.float32), kw, vw, causal=causal)
    yard = [_yardstick(q, k8, v8, kd, vd, causal, r) for r in range(4)]
    assert_within_rule("o", o, ref, yard, BFLOAT16, FACTOR)


def test_fp8_cache_plans_the_kv8_kernel(monkeypatch, rng):
    """The call launches attn_decode_kv8 (or its cluster form), never a 16-bit kernel."""
    seen = []
    real = plan_decode._kernel_spec

    def spy(*a, **k):
        spec = real(*a, **k)
        seen.append(spec.expression)
        return spec

    monkeypatch.setattr(plan_decode, "_kernel_spec", spy)
    b, hq, hkv, nq, nk, d = 1, 32, 8, 1, 2048, 128
    q = rng.standard_normal((b, hq, nq, d)).astype(BFLOAT16)
    k8, v8 = _codes(rng, (b, hkv, nk, d)), _codes(rng, (b, hkv, nk, d))
    kd, vd = _descales(rng, b, hkv, False)
    _run(q, k8, v8, kd, vd)
    assert seen and all("_kv8<" in e for e in seen), seen


def test_fp8_cache_as_a_float8_dtype(rng):
    """Where CuPy stores float8_e4m3fn arrays, they are taken as the uint8 bits are (bit for bit)."""
    try:
        probe = cupy.zeros(1, dtype=np.uint8).view(E4M3)
    except Exception as exc:  # noqa: BLE001 - CuPy without float8 dtypes
        pytest.skip(f"CuPy holds no float8_e4m3fn arrays: {type(exc).__name__}")
    assert probe.dtype == E4M3
    b, hq, hkv, nk, d = 2, 8, 2, 1024, 128
    q = cupy.asarray(rng.standard_normal((b, hq, 1, d)).astype(BFLOAT16))
    k8, v8 = _device(_codes(rng, (b, hkv, nk, d))), _device(_codes(rng, (b, hkv, nk, d)))
    kd, vd = (cupy.asarray(x) for x in _descales(rng, b, hkv, True))
    bits = cuflash.attention(q, k8, v8, k_descale=kd, v_descale=vd)
    typed = cuflash.attention(q, k8.view(E4M3), v8.view(E4M3), k_descale=kd, v_descale=vd)
    assert bool((bits.view(np.uint16) == typed.view(np.uint16)).all())


def test_fp8_cache_refuses_other_shapes(rng):
    """Prefill shapes, score modifiers and d not a multiple of 16 raise NotImplementedError."""
    q = cupy.asarray(rng.standard_normal((1, 4, 64, 128)).astype(BFLOAT16))
    k = _device(_codes(rng, (1, 4, 512, 128)))
    one = dict(k_descale=cupy.ones((), np.float32), v_descale=cupy.ones((), np.float32))
    with pytest.raises(NotImplementedError, match="split-KV decode kernel"):
        cuflash.attention(q, k, k, **one)
    with pytest.raises(NotImplementedError, match="softcap"):
        cuflash.attention(q[:, :, :1], k, k, softcap=30.0, **one)
    q40 = cupy.asarray(rng.standard_normal((1, 4, 1, 40)).astype(BFLOAT16))
    k40 = _device(_codes(rng, (1, 4, 512, 40)))
    with pytest.raises(NotImplementedError, match="multiple of 16"):
        cuflash.attention(q40, k40, k40, **one)
    with pytest.raises(TypeError, match="k_descale"):
        cuflash.attention(q[:, :, :1], k, k, k_descale=np.float64(1.0))
    with pytest.raises(TypeError, match="uint8"):  # (bits without descales are not taken for e4m3)
        cuflash.attention(q[:, :, :1], k, k)
