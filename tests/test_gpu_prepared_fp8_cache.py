"""prepare_attention and cuflash.attention's plan cache with an e4m3 (FP8) K/V cache on the GPU: the
decode fast path (attn_decode_kv8 launched from a packed parameter block) against the uncached
path, bit for bit, with fresh data and fresh descale values every call and poisoned outputs;
contiguous and paged caches, descales per tensor and per (sequence, K/V head), kv_lens, windows,
every merge of the splits; the checks and errors of the uncached path; torch float8_e4m3fn tensors.

Descales are powers of two (as in test_gpu_fp8_kv_cache.py), so that the first call of each case is
also checked against the float64 reference of the dequantized cache."""

import numpy as np
import pytest

import cuflash
from cuflash.api import plan_cache
from cuflash.core.arrays import BFLOAT16, FLOAT16
from cuflash.kernels import decode as decode_kernels
from cuflash.kernels import pdl
from cuflash.plan import decode as plan_decode

from _kvlens_check import check_per_sequence
from test_gpu_fp8_kv_cache import _codes, _dequantized16
from test_gpu_plan_cache import assert_cached_calls_equal_uncached
from test_gpu_prepared import _bits, on_side_stream
from test_paged import paged_cache

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.fixture
def uncached():
    """cuflash.attention uncached inside the block (the path a prepared or cached call must equal)."""
    def call(*args, **kw):
        with plan_cache.disabled():
            return cuflash.attention(*args, **kw)
    return call


@pytest.fixture
def fresh_cache(monkeypatch):
    monkeypatch.setattr(plan_cache, "enabled", True)
    plan_cache.clear()
    yield
    plan_cache.clear()


# (b, hq, hkv, nq, nk, d): which merge the planner picks on an H100 / H200 (132 SMs)
SHAPES = {
    "cluster-split": (2, 8, 2, 1, 1500, 128),  # a few splits merged in a cluster
    "long-split": (1, 4, 4, 1, 40000, 128),  # long splits through the float32 workspace
    "many-pairs": (40, 16, 4, 1, 600, 64),  # 160 (sequence, K/V head) pairs, d = 64
    "gqa-5-tokens": (3, 16, 4, 5, 2000, 128),  # 20 packed rows (two row tiles)
    "d256": (2, 4, 4, 1, 1024, 256),
}

# (kind of cache and mask, descale granularity): a paged cache takes per-tensor descales only.
# (CuPy holds e4m3 as uint8 bits, which only descales mark as e4m3: no descales ("none") is
# torch float8_e4m3fn tensors' form, tested below.)
# "k-only": k_descale alone (v's factor 1: the unit descale's constant address in a prepared launch).
CASES = [("plain", "per-tensor"), ("lens", "per-head"), ("lens", "per-tensor"), ("lens", "k-only"),
         ("window", "per-head"), ("window", "per-tensor"), ("paged", "per-tensor")]
CASE_IDS = [f"{c}-{g}" for c, g in CASES]


def _descales(rng, b, hkv, granularity):
    """Power-of-two float32 descales on the device: (k, v) per (sequence, K/V head), per tensor
    (shape ()), k's alone (shape (1,)), or (None, None); and their host values (1 for None)."""
    if granularity == "none":
        return (None, None), (np.float32(1), np.float32(1))
    shape = {"per-head": (b, hkv), "per-tensor": (), "k-only": (1,)}[granularity]
    host = [np.ldexp(np.float32(1), rng.integers(-9, -5, size=shape)).astype(np.float32) for _ in "kv"]
    if granularity == "k-only":
        return (cupy.asarray(host[0]), None), (host[0].reshape(()), np.float32(1))
    return tuple(cupy.asarray(x) for x in host), tuple(host)


def _case(rng, shape, dtype, case, granularity):
    """Fresh arrays of one geometry: (args, kwargs, host) with the cache's e4m3 bits as CuPy uint8
    and host = the q, the dequantized cache in q's dtype and the lengths for the reference."""
    b, hq, hkv, nq, nk, d = shape
    q = rng.standard_normal((b, hq, nq, d)).astype(dtype)
    k8, v8 = _codes(rng, (b, hkv, nk, d)), _codes(rng, (b, hkv, nk, d))
    (kd, vd), (kd_host, vd_host) = _descales(rng, b, hkv, granularity)
    lens = rng.integers(2, nk + 1, size=b).astype(np.int32)
    if b >= 3:
        lens[:2] = [0, 1]
    if case == "plain":
        lens[:] = nk
    kw = {n: x for n, x in (("k_descale", kd), ("v_descale", vd)) if x is not None}
    if case == "paged":
        bs = 64
        used = sum(-(-int(n) // bs) for n in lens)  # (the same cache size every call: the geometry)
        kc, vc, table = paged_cache(rng, k8.view(np.uint8).astype(np.float32), v8.view(np.uint8).astype(np.float32),
                                    lens, bs, spare=b * -(-nk // bs) + 3 - used)
        kc, vc = (np.where(np.isnan(c), 0x7F, c).astype(np.uint8) for c in (kc, vc))  # unused pages: e4m3 NaN
        args = (cupy.asarray(q), cupy.asarray(kc), cupy.asarray(vc))
        kw.update(kv_lens=cupy.asarray(lens), block_table=cupy.asarray(table))
    else:
        args = (cupy.asarray(q), cupy.asarray(k8.view(np.uint8)), cupy.asarray(v8.view(np.uint8)))
        if case != "plain":
            kw["kv_lens"] = cupy.asarray(lens)
    host = dict(q=q, k=_dequantized16(k8, kd_host, dtype), v=_dequantized16(v8, vd_host, dtype), lens=lens)
    return args, kw, host


def _opts(case, validate=True):
    causal = "bottom_right" if case != "plain" else False
    return dict(causal=causal, window=(333, 0) if case == "window" else None, return_lse=True, validate=validate)


def _check_reference(o, lse, host, case, dtype):
    opts = _opts(case)
    check_per_sequence(o, lse, host["q"], host["k"], host["v"], host["lens"], opts["causal"], dtype,
                       window=opts["window"])


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("case,granularity", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("validate", [True, False], ids=["validate", "no-validate"])
def test_prepared_fp8_cache_matches_attention(uncached, shape, case, granularity, validate):
    # Three calls with fresh arrays of the prepared geometry (new addresses, new cache, descale and
    # kv_lens values): each result equals the uncached cuflash.attention's bit for bit; the first
    # also the reference. Outputs poisoned, inputs untouched.
    rng = np.random.default_rng([len(shape), len(case), len(granularity), validate])
    dtype = (BFLOAT16, FLOAT16)[(list(SHAPES).index(shape) + CASES.index((case, granularity))) % 2]
    opts = _opts(case, validate)
    args, kw, _ = _case(rng, SHAPES[shape], dtype, case, granularity)
    run = cuflash.prepare_attention(*args, **opts, **kw)
    assert run.path == "decode", run
    assert "_kv8<" in run.kernel[0], run.kernel
    for trial in range(3):
        args, kw, host = _case(rng, SHAPES[shape], dtype, case, granularity)
        before = [_bits(a).copy() for a in (*args, *kw.values())]
        out = cupy.full(args[0].shape, np.nan, dtype=dtype)
        o, lse = run(*args, out=out, **kw)
        assert o is out
        want_o, want_lse = uncached(*args, **opts, **kw)
        np.testing.assert_array_equal(_bits(o), _bits(want_o))
        np.testing.assert_array_equal(_bits(lse), _bits(want_lse))
        for a, a0 in zip((*args, *kw.values()), before):
            np.testing.assert_array_equal(_bits(a), a0)  # inputs untouched
        if trial == 0:
            _check_reference(o, lse, host, case, dtype)


@pytest.mark.parametrize("granularity", ["per-head", "per-tensor"])
def test_prepared_fp8_cache_follows_the_descale_values(uncached, granularity):
    # The same cache and q with new descale values (same geometry): the result changes, and equals
    # the uncached call with those values; v_descale doubled doubles o exactly (powers of two).
    rng = np.random.default_rng([len(granularity), 71])
    args, kw, _ = _case(rng, SHAPES["cluster-split"], BFLOAT16, "lens", granularity)
    run = cuflash.prepare_attention(*args, **kw)
    o1 = run(*args, **kw)
    np.testing.assert_array_equal(_bits(o1), _bits(uncached(*args, **kw)))
    doubled = dict(kw, v_descale=kw["v_descale"] * np.float32(2))
    o2 = run(*args, **doubled)
    np.testing.assert_array_equal(_bits(o2), _bits(uncached(*args, **doubled)))
    o1_host, o2_host = (o.get().astype(np.float32) for o in (o1, o2))
    np.testing.assert_array_equal(o2_host, 2 * o1_host)
    assert (o1_host != 0).any()
    halved_k = dict(kw, k_descale=kw["k_descale"] * np.float32(0.5))
    o3 = run(*args, **halved_k)
    np.testing.assert_array_equal(_bits(o3), _bits(uncached(*args, **halved_k)))
    assert not np.array_equal(_bits(o3), _bits(o1))  # (other scores: another softmax)


def test_prepared_fp8_cache_fresh_outputs_bshd_and_combine(uncached, monkeypatch):
    # No out=: fresh outputs; "bshd"; o alone. Then the combine kernel as a programmatic dependent
    # (as attention launches it for caches of 512 MiB and more: the gate lowered to every cache).
    rng = np.random.default_rng(73)
    b, hq, hkv, nq, nk, d = 4, 32, 8, 2, 3000, 128
    q = rng.standard_normal((b, nq, hq, d)).astype(FLOAT16)
    k8, v8 = _codes(rng, (b, nk, hkv, d)), _codes(rng, (b, nk, hkv, d))
    (kd, vd), _ = _descales(rng, b, hkv, "per-head")
    args = (cupy.asarray(q), cupy.asarray(k8.view(np.uint8)), cupy.asarray(v8.view(np.uint8)))
    run = cuflash.prepare_attention(*args, layout="bshd", causal=True, k_descale=kd, v_descale=vd)
    assert run.path == "decode"
    o = run(*args, k_descale=kd, v_descale=vd)
    want = uncached(*args, layout="bshd", causal=True, k_descale=kd, v_descale=vd)
    np.testing.assert_array_equal(_bits(o), _bits(want))

    if not pdl.available():
        pytest.skip("programmatic dependent launch needs sm_90 and cuda-bindings")
    monkeypatch.setattr(decode_kernels, "PDL_COMBINE_MIN_BYTES", 0)
    monkeypatch.setattr(plan_decode, "MERGE", "kernel")  # (by default the last split merges: no combine)
    args, kw, host = _case(rng, SHAPES["long-split"], BFLOAT16, "lens", "per-head")
    run = cuflash.prepare_attention(*args, return_lse=True, causal="bottom_right", **kw)
    assert run._decode.combine is not None and len(run.kernel) == 2  # (programmatic below 128 splits)
    out = cupy.full(args[0].shape, np.nan, dtype=BFLOAT16)
    o, lse = run(*args, out=out, **kw)
    want_o, want_lse = uncached(*args, return_lse=True, causal="bottom_right", **kw)
    np.testing.assert_array_equal(_bits(o), _bits(want_o))
    np.testing.assert_array_equal(_bits(lse), _bits(want_lse))
    _check_reference(o, lse, host, "lens", BFLOAT16)


def test_prepared_fp8_cache_checks_and_errors(uncached):
    # Per call the values and out= are checked as attention checks them; other descale geometries
    # raise ValueError naming the descale; a cache that is not 16-byte aligned raises attention's
    # NotImplementedError (the call runs attention).
    rng = np.random.default_rng(79)
    args, kw, _ = _case(rng, SHAPES["cluster-split"], BFLOAT16, "lens", "per-head")
    run = cuflash.prepare_attention(*args, **kw)
    assert run.path == "decode"
    bad = kw["kv_lens"].copy()
    bad[0] = 10**6
    with pytest.raises(ValueError, match="^kv_lens: values must lie in"):
        run(*args, **dict(kw, kv_lens=bad))
    with pytest.raises(ValueError, match="out: must not overlap input q"):
        run(*args, out=args[0], **kw)
    with pytest.raises(TypeError, match="out: expected dtype bfloat16"):
        run(*args, out=cupy.empty(args[0].shape, dtype=np.float16), **kw)
    with pytest.raises(ValueError, match=r"^k_descale: prepared for cupy shape \(2, 2\)"):
        run(*args, **dict(kw, k_descale=cupy.ones((), np.float32)))
    with pytest.raises(ValueError, match="^v_descale: prepared for cupy .*, got not given"):
        run(*args, kv_lens=kw["kv_lens"], k_descale=kw["k_descale"])
    with pytest.raises(ValueError, match="^k_descale: prepared for cupy .*, got ndarray shape"):
        run(*args, **dict(kw, k_descale=kw["k_descale"].get()))
    with pytest.raises(ValueError, match="^v_descale: prepared for .*strides"):
        run(*args, **dict(kw, v_descale=cupy.asfortranarray(kw["v_descale"])))
    # The same geometry 1 byte off alignment: attention's NotImplementedError, from the call.
    k = args[1]
    buf = cupy.empty(k.size + 16, dtype=np.uint8)
    ku = buf[1:1 + k.size].reshape(k.shape)
    ku[...] = k
    assert ku.strides == k.strides and ku.data.ptr % 16
    with pytest.raises(NotImplementedError, match="split-KV decode kernel only") as prepared_error:
        run(args[0], ku, args[2], **kw)
    with pytest.raises(NotImplementedError) as attention_error:
        uncached(args[0], ku, args[2], **kw)
    assert str(prepared_error.value) == str(attention_error.value)


def test_prepared_fp8_cache_attention_path(uncached):
    # Descales attention copies first (a per-tensor factor beside a per-head one; per-head factors
    # not in C order) and prefill shapes take the "attention" path: the same results and errors.
    rng = np.random.default_rng(83)
    args, kw, _ = _case(rng, SHAPES["cluster-split"], BFLOAT16, "lens", "per-head")
    for descales in (dict(k_descale=kw["k_descale"], v_descale=cupy.full((), 0.25, np.float32)),
                     dict(k_descale=cupy.asfortranarray(kw["k_descale"]),
                          v_descale=cupy.asfortranarray(kw["v_descale"]))):
        run = cuflash.prepare_attention(*args, kv_lens=kw["kv_lens"], causal=True, **descales)
        assert run.path == "attention"
        o = run(*args, kv_lens=kw["kv_lens"], **descales)
        np.testing.assert_array_equal(_bits(o), _bits(uncached(*args, kv_lens=kw["kv_lens"], causal=True,
                                                               **descales)))
    q = cupy.asarray(rng.standard_normal((1, 4, 64, 128)).astype(BFLOAT16))
    k = cupy.asarray(_codes(rng, (1, 4, 512, 128)).view(np.uint8))
    one = dict(k_descale=cupy.ones((), np.float32), v_descale=cupy.ones((), np.float32))
    run = cuflash.prepare_attention(q, k, k, **one)
    assert run.path == "attention"
    with pytest.raises(NotImplementedError, match="split-KV decode kernel only"):
        run(q, k, k, **one)


def test_prepared_fp8_cache_torch():
    # torch float8_e4m3fn tensors (no descales: 1) and uint8 bits with descales, on a side stream:
    # tensors equal bit for bit to cuflash.attention's on the same tensors.
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without float8_e4m3fn")
    rng = np.random.default_rng(89)
    for granularity in ("none", "per-head"):
        args, kw, host = _case(rng, SHAPES["cluster-split"], BFLOAT16, "lens", granularity)
        targs = [torch.from_dlpack(a) for a in args]
        if granularity == "none":
            targs[1:] = [t.view(torch.float8_e4m3fn) for t in targs[1:]]
        tkw = {n: torch.from_dlpack(a) for n, a in kw.items()}
        run = cuflash.prepare_attention(*targs, causal=True, return_lse=True, **tkw)
        assert run.path == "decode"
        def calls():
            out = torch.full_like(targs[0], float("nan"))
            got = run(*targs, out=out, **tkw)
            with plan_cache.disabled():
                return out, got, cuflash.attention(*targs, causal=True, return_lse=True, **tkw)
        out, (o, lse), (want_o, want_lse) = on_side_stream(torch, calls)
        assert o is out and o.dtype == torch.bfloat16
        assert torch.equal(o.view(torch.int16), want_o.view(torch.int16)) and torch.equal(lse, want_lse)
        if granularity != "none":  # (unscaled codes up to 448: the reference runs on scaled ones)
            check_per_sequence(cupy.from_dlpack(o.view(torch.int16)).view(BFLOAT16), cupy.from_dlpack(lse),
                               host["q"], host["k"], host["v"], host["lens"], True, BFLOAT16)
        with pytest.raises(ValueError, match="^k: prepared for torch"):
            run(targs[0], targs[1].view(torch.uint8 if granularity == "none" else torch.int8), targs[2], **tkw)


# ----------------------------------------------------------------------------- the plan cache


@pytest.mark.parametrize("shape", ["cluster-split", "gqa-5-tokens", "many-pairs"])
@pytest.mark.parametrize("case,granularity", CASES, ids=CASE_IDS)
def test_cached_fp8_cache_calls_equal_uncached(fresh_cache, shape, case, granularity):
    # Four calls of one geometry with fresh arrays (cache, descales, kv_lens): the second prepares
    # the plan and the last three run from it (hits). Each equals the uncached call bit for bit (o
    # into a NaN-poisoned out= on odd calls, fresh on even ones); the first also the reference.
    rng = np.random.default_rng([len(shape), len(case), len(granularity), 97])
    assert_cached_calls_equal_uncached(lambda: _case(rng, SHAPES[shape], BFLOAT16, case, granularity), _opts(case),
                                       lambda o, lse, host: _check_reference(o, lse, host, case, BFLOAT16))
    assert plan_cache.stats()["plans"] == 1


def test_cached_fp8_cache_keys_and_checks(uncached, fresh_cache):
    # Descales of another geometry are another plan; new descale values in one geometry hit the
    # plan and change the result as the uncached path does; values and out= are still checked; a
    # cache 1 byte off alignment runs uncached (attention's error).
    rng = np.random.default_rng(101)
    args, kw, _ = _case(rng, SHAPES["cluster-split"], BFLOAT16, "lens", "per-head")
    for _ in range(2):
        cuflash.attention(*args, **kw)
    assert plan_cache.stats()["plans"] == 1
    hits = plan_cache.stats()["hits"]
    doubled = dict(kw, v_descale=kw["v_descale"] * np.float32(2))
    o1, o2 = cuflash.attention(*args, **kw), cuflash.attention(*args, **doubled)
    assert plan_cache.stats()["hits"] - hits == 2
    np.testing.assert_array_equal(_bits(o2), _bits(uncached(*args, **doubled)))
    o1_host, o2_host = (o.get().astype(np.float32) for o in (o1, o2))
    np.testing.assert_array_equal(o2_host, 2 * o1_host)
    assert (o1_host != 0).any()
    per_tensor = dict(kw, k_descale=cupy.full((), 2.0**-7, np.float32), v_descale=cupy.full((), 2.0**-8, np.float32))
    for _ in range(3):
        o = cuflash.attention(*args, **per_tensor)
        np.testing.assert_array_equal(_bits(o), _bits(uncached(*args, **per_tensor)))
    assert plan_cache.stats()["plans"] == 2 and plan_cache.stats()["hits"] - hits == 4
    unscaled = {"kv_lens": kw["kv_lens"]}
    with pytest.raises(TypeError, match="uint8"):  # (bits without descales are not taken for e4m3)
        cuflash.attention(*args, **unscaled)
    bad = dict(kw, kv_lens=kw["kv_lens"] + 10**6)
    with pytest.raises(ValueError, match="^kv_lens: values must lie in"):
        cuflash.attention(*args, **bad)
    with pytest.raises(ValueError, match="out: must not overlap input q"):
        cuflash.attention(*args, out=args[0], **kw)
    k = args[1]
    buf = cupy.empty(k.size + 16, dtype=np.uint8)
    ku = buf[1:1 + k.size].reshape(k.shape)
    ku[...] = k
    hits = plan_cache.stats()["hits"]
    with pytest.raises(NotImplementedError, match="split-KV decode kernel only"):
        cuflash.attention(args[0], ku, args[2], **kw)
    assert plan_cache.stats()["hits"] == hits


@pytest.mark.parametrize("granularity", ["none", "per-tensor"])
def test_cached_fp8_cache_torch(fresh_cache, granularity):
    # torch float8_e4m3fn paged caches, unscaled (the plan's unit descales) or with descales: the
    # second and third calls run from the plan, equal to the uncached calls bit for bit.
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without float8_e4m3fn")
    rng = np.random.default_rng([len(granularity), 103])
    hits = plan_cache.stats()["hits"]
    side = torch.cuda.Stream()
    for _ in range(3):
        args, kw, _ = _case(rng, SHAPES["cluster-split"], BFLOAT16, "paged", granularity)
        targs = [torch.from_dlpack(a) for a in args]
        targs[1:] = [t.view(torch.float8_e4m3fn) for t in targs[1:]]
        tkw = {n: torch.from_dlpack(a) for n, a in kw.items()}
        side.wait_stream(torch.cuda.current_stream())  # the copies of this call's inputs
        with torch.cuda.stream(side):
            o, lse = cuflash.attention(*targs, causal=True, return_lse=True, **tkw)
            with plan_cache.disabled():
                want_o, want_lse = cuflash.attention(*targs, causal=True, return_lse=True, **tkw)
        side.synchronize()
        assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16
        assert torch.equal(o.view(torch.int16), want_o.view(torch.int16)) and torch.equal(lse, want_lse)
    assert plan_cache.stats()["hits"] - hits == 2
