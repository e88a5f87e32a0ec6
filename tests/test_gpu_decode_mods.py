"""Score modifiers (softcap, ALiBi slopes, sinks) in the split-KV decode kernel (attn_decode_mod,
attn_decode_cluster_mod) against the float64 reference, by the accuracy rule, one sequence at a time
(each over its own kv_lens[b] keys, its own ALiBi distances and slopes).

Packed rows of several query heads (GQA groups, several tokens, two row tiles, row blocks, the
wide-rows blocks), each with its own slope and sink; kv_lens 0 and 1 (a row with only its sink:
o = 0, lse = the sink); causal and windows; paged caches whose unused pages hold NaN; every way
the splits merge (one split, the cluster, the last split, attn_decode_combine), where a sink must
count exactly once. Outputs and every allocation cuflash makes are NaN-poisoned first."""

import numpy as np
import pytest

import cuflash
from cuflash.backends import cuda as cuda_backend
from cuflash.core.arrays import BFLOAT16, FLOAT16
from cuflash.core.problem import check_score_mods, validate_forward
from cuflash.kernels import decode as decode_kernels
from cuflash.plan import schedule
from cuflash.testing import assert_forward_accurate, poison, poisoned_allocations, random_inputs, to_numpy

from _brute_mask import brute_visible
from test_paged import paged_cache
from test_score_mods import make_mods

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

DTYPES = [pytest.param(FLOAT16, id="f16"), pytest.param(BFLOAT16, id="bf16")]
WHICH = ["softcap", "alibi", "alibi_batch", "sinks", "all"]
_UINT = {2: np.uint16, 4: np.uint32}


def to_device(a):
    a = np.ascontiguousarray(a)
    return cupy.asarray(a.view(_UINT[a.dtype.itemsize])).view(a.dtype)


def on_device(mods):
    return {n: (to_device(v) if isinstance(v, np.ndarray) else v) for n, v in mods.items()}


def _sequence_mods(mods, b):
    """Sequence b's modifiers: its row of (B, Hq) slopes."""
    a = mods.get("alibi_slopes")
    return dict(mods, alibi_slopes=a[b]) if a is not None and a.ndim == 2 else dict(mods)


def check(o, lse, q, k, v, lens, mods, causal=False, window=None):
    """Sequence b of (B, H, N, d) results against the reference over its first lens[b] keys."""
    o, lse = to_numpy(o), to_numpy(lse)
    for b, n in enumerate(int(x) for x in lens):
        masking = dict(causal=causal) if window is None else dict(mask=brute_visible(causal, window, q.shape[2], n))
        try:
            assert_forward_accurate(o[b:b + 1], lse[b:b + 1], q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n],
                                    **masking, **_sequence_mods(mods, b))
        except AssertionError as exc:
            raise AssertionError(f"sequence {b} (kv_lens {n}): {exc}") from exc


def attention(q, k, v, mods, **kw):
    """cuflash.attention on the device, o and every allocation poisoned, inputs checked unchanged."""
    dev = [to_device(a) for a in (q, k, v)]
    before = [a.view(np.uint8).get().tobytes() for a in dev]
    out = poison(cupy.empty(dev[0].shape, dtype=dev[0].dtype))
    o, lse = poisoned_allocations(lambda: cuflash.attention(*dev, return_lse=True, out=out, **kw, **on_device(mods)))
    assert [a.view(np.uint8).get().tobytes() for a in dev] == before, "an input was modified"
    return o, lse


def _lens(rng, b, nk):
    return np.array([0, 1, int(rng.integers(2, nk)), nk] + [int(rng.integers(256, nk))] * (b - 4), np.int32)


# (Hq, Hkv, nq, d): one row tile (GQA 4 x 3 tokens), two (GQA 4 x 8 tokens at d = 128), row blocks
# (GQA 8 x 16 tokens at d = 64: two blocks of 64 rows), the wide-rows blocks (MQA, 64 heads), d = 256.
GEOMETRIES = [(8, 2, 3, 128), (16, 4, 8, 128), (16, 2, 16, 64), (64, 1, 1, 128), (4, 4, 2, 256)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", WHICH)
@pytest.mark.parametrize("causal", [False, "bottom_right", "top_left"])
@pytest.mark.parametrize("hq,hkv,nq,d", GEOMETRIES)
def test_decode_with_modifiers_kv_lens(rng, dtype, which, causal, hq, hkv, nq, d):
    b, nk = 4, 1500
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), dtype)
    lens = _lens(rng, b, nk)
    mods = make_mods(rng, which, hq, b)
    o, lse = attention(q, k, v, mods, causal=causal, kv_lens=to_device(lens))
    check(o, lse, q, k, v, lens, mods, causal=causal)


@pytest.mark.parametrize("which", WHICH)
@pytest.mark.parametrize("window", [(100, 0), (37, -1), (-1, 3)])
def test_decode_with_modifiers_window(rng, which, window):
    b, hq, hkv, nq, nk, d = 3, 8, 2, 4, 3000, 64
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), FLOAT16)
    mods = make_mods(rng, which, hq, b)
    o, lse = attention(q, k, v, mods, causal="bottom_right", window=window)
    check(o, lse, q, k, v, [nk] * b, mods, causal="bottom_right", window=window)


@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("window", [None, (100, 0)])
@pytest.mark.parametrize("which", ["alibi_batch", "all"])
def test_decode_with_modifiers_paged(rng, bs, window, which):
    """Pages read in place; unused pages hold NaN, so reading one shows."""
    b, hq, hkv, nq, nk, d = 5, 16, 4, 2, 1300, 128
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), BFLOAT16)
    lens = np.array([0, 1, 257, 1300, 999], dtype=np.int32)
    mods = make_mods(rng, which, hq, b)
    kc, vc, table = paged_cache(rng, k, v, lens, bs)
    dev = [to_device(a) for a in (q, kc, vc)]
    out = poison(cupy.empty(dev[0].shape, dtype=dev[0].dtype))
    o, lse = poisoned_allocations(lambda: cuflash.attention(
        *dev, block_table=cupy.asarray(table), kv_lens=cupy.asarray(lens), causal="bottom_right", window=window,
        return_lse=True, out=out, **on_device(mods)))
    check(o, lse, q, k, v, lens, mods, causal="bottom_right", window=window)


@pytest.mark.parametrize("splits,cluster,merge", [(1, None, None), (2, True, None), (4, True, None), (8, True, None),
                                                  (3, False, "last"), (7, False, "kernel"), (40, False, "last"),
                                                  (40, False, "kernel")])
@pytest.mark.parametrize("hq,hkv,nq", [(8, 2, 3), (16, 2, 4)])  # one row tile, two
def test_decode_with_modifiers_split_merges(rng, splits, cluster, merge, hq, hkv, nq):
    """Every way the splits merge, with kv_lens that leave splits (split 0's included, for kv_lens 0)
    without keys: each row's sink must reach its sum once."""
    b, nk, d = 4, 4000, 128
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), BFLOAT16)
    lens = np.array([0, 1, 2500, 4000], np.int32)
    mods = make_mods(rng, "all", hq, b)
    qg, kg, vg = (to_device(a) for a in (q, k, v))
    p = check_score_mods(validate_forward(qg, kg, vg, causal="bottom_right"), qg, **on_device(mods))
    o4 = poison(cupy.empty(qg.shape, dtype=qg.dtype))
    lse3 = cupy.full((b, hq, nq), np.nan, dtype=np.float32)
    poisoned_allocations(lambda: decode_kernels.forward(p, qg, kg, vg, o4, lse3, kv_lens=cupy.asarray(lens),
                                                        splits=splits, cluster=cluster, merge=merge))
    check(o4, lse3, q, k, v, lens, mods, causal="bottom_right")


def test_large_scores_and_long_distances(rng):
    """Scores far beyond the cap (inputs x 3) and ALiBi biases over 20k keys."""
    b, hq, hkv, nq, nk, d = 2, 8, 2, 2, 20000, 128
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), FLOAT16, scale=3.0)
    mods = dict(softcap=20.0, alibi_slopes=rng.uniform(1e-4, 0.01, (b, hq)).astype(np.float32),
                sinks=(rng.standard_normal(hq) * 4).astype(np.float32))
    o, lse = attention(q, k, v, mods, causal=True)
    check(o, lse, q, k, v, [nk] * b, mods, causal=True)


def test_the_decode_kernel_runs(monkeypatch, rng):
    """Contiguous, kv_lens and paged calls in decode shapes launch attn_decode_mod (or its cluster
    form) once for the whole batch - not the band kernels, not one problem per sequence."""
    launched, calls = [], []
    real_spec, real_forward = decode_kernels.launch_spec, decode_kernels.forward
    monkeypatch.setattr(decode_kernels, "launch_spec",
                        lambda *a, **kw: launched.append(real_spec(*a, **kw).expression) or real_spec(*a, **kw))
    monkeypatch.setattr(decode_kernels, "forward",
                        lambda p, *a, **kw: calls.append(p.batch) or real_forward(p, *a, **kw))

    def no_band(*a, **kw):
        raise AssertionError("the band kernel ran")

    monkeypatch.setattr(cuda_backend, "forward_band", no_band)
    b, hq, hkv, nq, nk, d = 3, 8, 2, 2, 2048, 128
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), BFLOAT16)
    lens = np.array([0, 700, 2048], np.int32)
    slopes = rng.uniform(0.01, 0.5, 2 * hq).astype(np.float32)
    mods = dict(softcap=30.0, alibi_slopes=to_device(slopes)[::2], sinks=to_device(rng.standard_normal(hq).astype(
        np.float32)))  # (a strided slopes view)
    ref_mods = dict(mods, alibi_slopes=slopes[::2].copy(), sinks=to_numpy(mods["sinks"]))
    kc, vc, table = paged_cache(rng, k, v, lens, 64)
    dq, dk, dv = (to_device(a) for a in (q, k, v))
    results = [cuflash.attention(dq, dk, dv, causal=True, return_lse=True, **mods),
               cuflash.attention(dq, dk, dv, causal=True, kv_lens=cupy.asarray(lens), return_lse=True,
                                 validate=False, **mods),
               cuflash.attention(dq, to_device(kc), to_device(vc), block_table=cupy.asarray(table),
                                 kv_lens=cupy.asarray(lens), causal=True, return_lse=True, **mods)]
    assert calls == [b, b, b], calls
    assert len(launched) == 3 and all(e.startswith(("attn_decode_mod<", "attn_decode_cluster_mod<"))
                                      for e in launched), launched
    for (o, lse), ls in zip(results, ([nk] * b, lens, lens)):
        check(o, lse, q, k, v, ls, ref_mods, causal=True)


def test_modifiers_refused_where_the_decode_kernel_has_none(rng):
    b, hq, hkv, nq, nk, d = 1, 8, 2, 1, 1024, 128
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, nk, d), BFLOAT16)
    qg, kg, vg = (to_device(a) for a in (q, k, v))
    p = check_score_mods(validate_forward(qg, kg, vg), qg, softcap=30.0)
    o4, lse3 = cupy.empty(qg.shape, dtype=qg.dtype), cupy.empty((b, hq, nq), dtype=np.float32)
    with pytest.raises(NotImplementedError, match="softcap"):
        decode_kernels.forward(p, qg, kg, vg, o4, lse3, tma_tile=schedule.DECODE_TMA_TILES[128])
