"""Paged KV cache (block_table=): NumPy backend and validation on the CPU; the split-KV decode
kernel reading pages in place (and the gathering prefill fallback) on the GPU. Each sequence is
checked against the float64 reference over its first kv_lens[b] keys of the contiguous cache
the pages were cut from; pages nobody uses are NaN, so reading one shows."""

import numpy as np
import pytest

import cuflash
from cuflash.core.arrays import BFLOAT16, FLOAT16, FLOAT32
from cuflash.testing import random_inputs
from cuflash.kernels import decode as decode_kernels

from _kvlens_check import check_per_sequence


def paged_cache(rng, k, v, lens, bs, spare=3):
    """Cut (B, Hkv, N, d) k, v into shuffled pages of bs keys: caches (num_blocks, bs, Hkv, d)
    with `spare` NaN pages, and a table whose unused entries are -1."""
    b, hkv, n, d = k.shape
    per = -(-n // bs)
    used = [-(-int(x) // bs) for x in lens]
    nb = sum(used) + spare
    kc = np.full((nb, bs, hkv, d), np.nan, dtype=k.dtype)
    vc = np.full((nb, bs, hkv, d), np.nan, dtype=k.dtype)
    table = np.full((b, per), -1, dtype=np.int32)
    order = rng.permutation(nb)
    i = 0
    for s in range(b):
        for j in range(used[s]):
            page = order[i]
            i += 1
            table[s, j] = page
            rows = slice(j * bs, min(n, (j + 1) * bs))
            m = rows.stop - rows.start
            kc[page, :m] = k[s, :, rows].transpose(1, 0, 2)
            vc[page, :m] = v[s, :, rows].transpose(1, 0, 2)
    return kc, vc, table


def run_paged(xp, rng, dtype, b, hq, hkv, nq, n, d, bs, lens, causal, layout="bhsd", window=None):
    """lens=None: no kv_lens argument, every sequence holds all of its table's keys (n must then
    be a multiple of bs). window: aligned on each sequence's own keys."""
    q, k, v = random_inputs(rng, (b, hq, nq, d), (b, hkv, n, d), dtype)
    given = lens is not None
    lens = lens if given else np.full(b, n, dtype=np.int32)
    kc, vc, table = paged_cache(rng, k, v, lens, bs)
    qx = q if layout == "bhsd" else np.ascontiguousarray(q.transpose(0, 2, 1, 3))
    args = [xp.asarray(a) for a in (qx, kc, vc, table, lens)]
    before = [a.copy() for a in args]
    out = xp.full(qx.shape, np.nan, dtype=dtype)  # poisoned: every element must be written
    o, lse = cuflash.attention(args[0], args[1], args[2], block_table=args[3], kv_lens=args[4] if given else None,
                               causal=causal, layout=layout, return_lse=True, out=out, window=window)
    for a, a0 in zip(args, before):
        assert bool((a.view(np.uint8) == a0.view(np.uint8)).all()), "an input was modified"
    o = o.get() if hasattr(o, "get") else o
    lse = lse.get() if hasattr(lse, "get") else lse
    if layout == "bshd":
        o = o.transpose(0, 2, 1, 3)
    check_per_sequence(o, lse, q, k, v, lens, causal, dtype, window=window)


@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16, FLOAT32], ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("causal", [False, "bottom_right", "top_left"], ids=["full", "br", "tl"])
@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("nq", [1, 7])
def test_paged_cpu(dtype, causal, bs, nq):
    rng = np.random.default_rng([nq, bs, len(str(causal)), dtype.itemsize])
    lens = np.array([0, 1, 77, 200], dtype=np.int32)
    run_paged(np, rng, dtype, 4, 4, 2, nq, 200, 32, bs, lens, causal)


# Windows that cut pages mid-way, one side open, one key wide, and wider than any sequence.
WINDOWS = [(40, 0), (33, -1), (-1, 5), (0, 0), (500, 500)]


@pytest.mark.parametrize("window", WINDOWS, ids=[f"w{l}_{r}" for l, r in WINDOWS])
@pytest.mark.parametrize("causal", [False, "bottom_right", "top_left"], ids=["full", "br", "tl"])
@pytest.mark.parametrize("nq", [1, 7])
def test_paged_cpu_window(window, causal, nq):
    rng = np.random.default_rng([nq, len(str(causal)), window[0] + 7, window[1] + 3])
    lens = np.array([0, 1, 77, 200], dtype=np.int32)
    run_paged(np, rng, BFLOAT16, 4, 4, 2, nq, 200, 32, 16, lens, causal, window=window)


def test_paged_cpu_bshd_without_kv_lens():
    run_paged(np, np.random.default_rng(5), BFLOAT16, 2, 4, 1, 3, 64, 16, 32, None, "top_left", layout="bshd")


def _valid(rng=None):
    rng = rng or np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 1, 16)).astype(np.float32)
    kc = rng.standard_normal((6, 16, 2, 16)).astype(np.float32)
    table = np.array([[0, 1, 2], [3, 4, 5]], dtype=np.int32)
    return q, kc, kc.copy(), table


@pytest.mark.parametrize("change, exc, msg", [
    (lambda a: a.update(k=a["k"][:, :12], v=a["v"][:, :12]), ValueError, "block_size"),
    (lambda a: a.update(block_table=a["block_table"].astype(np.int64)), TypeError, "block_table: expected dtype int32"),
    (lambda a: a.update(block_table=a["block_table"][:1]), ValueError, "block_table: expected shape"),
    (lambda a: a["block_table"].__setitem__((1, 0), 6), ValueError, "block_table: sequence 1 uses page 6"),
    (lambda a: a["block_table"].__setitem__((0, 2), -1), ValueError, "block_table: sequence 0 uses page -1"),
    (lambda a: a.update(q=a["q"][0]), ValueError, "q: with block_table expected 4 dimensions"),
    (lambda a: a.update(v=a["v"][:, :, :1]), ValueError, "v: shape"),
    (lambda a: a.update(kv_lens=np.array([49, 0], dtype=np.int32)), ValueError, "kv_lens"),
    (lambda a: a.update(window=(4, -2)), ValueError, "window: expected values >= -1"),
    (lambda a: a.update(window=(4, 0.5)), TypeError, "window: expected a pair of ints"),
])
def test_paged_validation(change, exc, msg):
    q, kc, vc, table = _valid()
    a = dict(q=q, k=kc, v=vc, block_table=table)
    change(a)
    with pytest.raises(exc, match=msg):
        cuflash.attention(a.pop("q"), a.pop("k"), a.pop("v"), **a)


def test_paged_unused_entries_are_not_checked_or_read():
    q, kc, vc, table = _valid()
    table[0, 2] = -7  # sequence 0 has 32 keys: two pages
    lens = np.array([32, 48], dtype=np.int32)
    o = cuflash.attention(q, kc, vc, block_table=table, kv_lens=lens)
    assert np.isfinite(o).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16], ids=["f16", "bf16"])
@pytest.mark.parametrize("causal", [False, "bottom_right"], ids=["full", "br"])
@pytest.mark.parametrize("nq", [1, 2, 7, 16])
@pytest.mark.parametrize("hq, hkv, d", [(32, 8, 128), (8, 2, 64), (4, 4, 256)])
@pytest.mark.parametrize("bs", [16, 64, 256])
def test_paged_gpu_decode(rng, dtype, causal, nq, hq, hkv, d, bs):
    import cupy

    n = 1300
    lens = np.array([0, 1, 257, 1300, 999], dtype=np.int32)
    run_paged(cupy, rng, dtype, 5, hq, hkv, nq, n, d, bs, lens, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_paged_gpu_prefill_fallback_and_layouts(rng, layout):
    import cupy

    lens = np.array([3, 300, 64], dtype=np.int32)
    run_paged(cupy, rng, BFLOAT16, 3, 8, 2, 40, 300, 128, 32, lens, "bottom_right", layout=layout)
    run_paged(cupy, rng, BFLOAT16, 3, 8, 2, 1, 300, 128, 32, lens, False, layout=layout)
    run_paged(cupy, rng, BFLOAT16, 3, 8, 2, 1, 320, 128, 32, None, "bottom_right", layout=layout)  # no kv_lens


@pytest.mark.gpu
@pytest.mark.parametrize("window", WINDOWS, ids=[f"w{l}_{r}" for l, r in WINDOWS])
@pytest.mark.parametrize("causal", [False, "bottom_right"], ids=["full", "br"])
@pytest.mark.parametrize("nq", [1, 7])
def test_paged_gpu_window(monkeypatch, rng, window, causal, nq):
    """A window in decode shapes: the split-KV kernel masks the band and reads the pages in place
    (only those the window reaches), the window on each sequence's own kv_lens[b] keys."""
    import cupy


    seen = []
    real = decode_kernels.forward
    monkeypatch.setattr(decode_kernels, "forward", lambda *a, **kw: seen.append(kw.get("paged")) or real(*a, **kw))
    lens = np.array([0, 1, 257, 1300, 999], dtype=np.int32)
    run_paged(cupy, rng, BFLOAT16, 5, 8, 2, nq, 1300, 128, 64, lens, causal, window=window)
    assert len(seen) == 1 and seen[0] is not None


@pytest.mark.gpu
def test_paged_gpu_runs_the_decode_kernel(monkeypatch):
    """Decode shapes read the pages in place (no gather): the decode launch sees the table."""
    import cupy


    seen = []
    real = decode_kernels.forward
    monkeypatch.setattr(decode_kernels, "forward", lambda *a, **kw: seen.append(kw.get("paged")) or real(*a, **kw))
    rng = np.random.default_rng(3)
    lens = np.array([500, 700], dtype=np.int32)
    run_paged(cupy, rng, BFLOAT16, 2, 8, 2, 1, 700, 128, 64, lens, False)
    assert seen and seen[0] is not None
