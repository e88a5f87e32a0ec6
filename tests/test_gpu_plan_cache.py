"""cuflash.attention's plan cache on the GPU: calls of a repeated decode geometry run from a plan
(cuflash.api.plan_cache), and every result equals the uncached path's bit for bit, on fresh arrays,
with poisoned outputs; bad values, other out= layouts, unaligned caches, threads and torch."""

import threading

import numpy as np
import pytest

import cuflash
from cuflash.api import plan_cache
from cuflash.core.arrays import BFLOAT16, FLOAT16
from cuflash.testing import random_inputs

from _kvlens_check import check_per_sequence
from test_gpu_prepared import SHAPES, _bits, _case

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(plan_cache, "enabled", True)
    plan_cache.clear()
    yield
    plan_cache.clear()


def _uncached(*args, **kw):
    with plan_cache.disabled():
        return cuflash.attention(*args, **kw)


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("case", ["plain", "lens", "paged", "window"])
def test_cached_calls_equal_uncached(shape, case):
    # Four calls of one geometry with fresh arrays: the first two prepare the plan, the last three
    # run from it. Each equals the uncached call bit for bit (o into a NaN-poisoned out= on odd
    # calls, fresh on even ones); the first is checked against the float64 reference too.
    rng = np.random.default_rng([len(shape), len(case), 41])
    causal = "bottom_right" if case != "plain" else False
    window = (333, 0) if case == "window" else None
    opts = dict(causal=causal, window=window, return_lse=True)
    assert_cached_calls_equal_uncached(
        lambda: _case(rng, SHAPES[shape], BFLOAT16, case), opts,
        lambda o, lse, host: check_per_sequence(o, lse, host["q"], host["k"], host["v"], host["lens"], causal,
                                                BFLOAT16, window=window))


def assert_cached_calls_equal_uncached(make_case, opts, check_reference):
    """Four calls of one geometry, each on fresh arrays (make_case() -> (args, kwargs, host)): the
    second prepares the plan and the last three run from it (hits). Each equals the uncached call
    bit for bit (o into a NaN-poisoned out= on odd calls, fresh on even ones) and leaves its inputs
    unchanged; the first also passes check_reference(o, lse, host)."""
    hits = plan_cache.stats()["hits"]
    for call in range(4):
        args, kw, host = make_case()
        before = [_bits(a).copy() for a in (*args, *kw.values())]
        out = cupy.full(args[0].shape, np.nan, dtype=BFLOAT16) if call % 2 else None
        o, lse = cuflash.attention(*args, out=out, **opts, **kw)
        assert out is None or o is out
        want_o, want_lse = _uncached(*args, **opts, **kw)
        np.testing.assert_array_equal(_bits(o), _bits(want_o))
        np.testing.assert_array_equal(_bits(lse), _bits(want_lse))
        for a, a0 in zip((*args, *kw.values()), before):
            np.testing.assert_array_equal(_bits(a), a0)
        if call == 0:
            check_reference(o, lse, host)
    assert plan_cache.stats()["hits"] - hits == 3


@pytest.mark.parametrize("form", ["bshd", "single-head", "fp16-causal-o-only"])
def test_cached_layouts(form):
    rng = np.random.default_rng([len(form), 43])
    nk = 2500
    hits = plan_cache.stats()["hits"]
    for call in range(3):
        if form == "single-head":
            q, k, v = random_inputs(rng, (3, 64), (nk, 64), BFLOAT16)
            kw = dict(return_lse=True)
        else:
            q, k, v = random_inputs(rng, (2, 16, 2, 128), (2, 4, nk, 128), FLOAT16 if form.startswith("fp16") else BFLOAT16)
            kw = dict(causal=True) if form.startswith("fp16") else dict(return_lse=True)
            if form == "bshd":
                q, k, v = (np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in (q, k, v))
                kw["layout"] = "bshd"
        g = [cupy.asarray(a) for a in (q, k, v)]
        got, want = cuflash.attention(*g, **kw), _uncached(*g, **kw)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            np.testing.assert_array_equal(_bits(a), _bits(b))
    assert plan_cache.stats()["hits"] - hits == 2


def test_cached_geometry_checks_each_call():
    # A planned geometry still checks each call's values and out= as attention does, and calls the
    # plan cannot take (out= of another layout, a K that is not 16-byte aligned) run uncached.
    rng = np.random.default_rng(47)
    args, kw, _ = _case(rng, SHAPES["cluster-split"], BFLOAT16, "paged")
    for _ in range(2):
        cuflash.attention(*args, **kw)
    assert plan_cache.stats()["plans"] == 1
    bad = kw["kv_lens"].copy()
    bad[0] = 10**6
    with pytest.raises(ValueError, match="^kv_lens: values must lie in"):
        cuflash.attention(*args, kv_lens=bad, block_table=kw["block_table"])
    table = kw["block_table"].copy()
    table[1, 0] = args[1].shape[0]
    with pytest.raises(ValueError, match="block_table"):
        cuflash.attention(*args, kv_lens=kw["kv_lens"], block_table=table)
    with pytest.raises(ValueError, match="out: must not overlap input q"):
        cuflash.attention(*args, out=args[0], **kw)
    with pytest.raises(TypeError, match="out: expected dtype bfloat16"):
        cuflash.attention(*args, out=cupy.empty(args[0].shape, dtype=np.float16), **kw)
    # An out= whose strides are not a fresh result's: attention writes it through a scratch array.
    strided = cupy.full(args[0].shape[::-1], np.nan, dtype=BFLOAT16).transpose(3, 2, 1, 0)
    hits = plan_cache.stats()["hits"]
    o = cuflash.attention(*args, out=strided, **kw)
    assert o is strided and plan_cache.stats()["hits"] == hits
    np.testing.assert_array_equal(_bits(o), _bits(_uncached(*args, **kw)))

    q, k, v = random_inputs(rng, (2, 8, 1, 128), (2, 2, 1500, 128), FLOAT16)
    qg, kg, vg = (cupy.asarray(a) for a in (q, k, v))
    for _ in range(2):
        cuflash.attention(qg, kg, vg)
    buf = cupy.empty(kg.size + 1, dtype=FLOAT16)
    ku = buf[1:].reshape(kg.shape)  # the same geometry, 2 bytes off alignment
    ku[...] = kg
    assert ku.strides == kg.strides and ku.data.ptr % 16
    hits = plan_cache.stats()["hits"]
    o = cuflash.attention(qg, ku, vg)
    assert plan_cache.stats()["hits"] == hits
    np.testing.assert_array_equal(_bits(o), _bits(_uncached(qg, ku, vg)))


def test_cached_calls_from_threads():
    # Threads share one plan (one packed parameter block): each thread's results are its own
    # arrays' (a launch made with another thread's addresses would differ).
    rng = np.random.default_rng(53)
    shape = SHAPES["no-split"]
    sets = [_case(rng, shape, BFLOAT16, "lens")[:2] for _ in range(6)]
    want = [_uncached(*args, **kw) for args, kw in sets]
    cuflash.attention(*sets[0][0], **sets[0][1])
    cuflash.attention(*sets[0][0], **sets[0][1])
    errors = []

    def worker(i):
        try:
            with cupy.cuda.Stream(non_blocking=True) as s:
                args, kw = sets[i]
                outs = [cuflash.attention(*args, **kw) for _ in range(8)]
                s.synchronize()
            for o in outs:
                np.testing.assert_array_equal(_bits(o), _bits(want[i]))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    cupy.cuda.Device().synchronize()  # the inputs, written on the default stream
    hits = plan_cache.stats()["hits"]
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(sets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert plan_cache.stats()["hits"] - hits == 8 * len(sets)


def test_cached_torch_calls():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(59)
    hits = plan_cache.stats()["hits"]
    side = torch.cuda.Stream()
    for _ in range(3):
        args, kw, _ = _case(rng, SHAPES["combine-split"], BFLOAT16, "lens")
        targs = [torch.from_dlpack(a) for a in args]
        tkw = {n: torch.from_dlpack(a) for n, a in kw.items()}
        side.wait_stream(torch.cuda.current_stream())  # the copies of this call's inputs
        with torch.cuda.stream(side):
            o, lse = cuflash.attention(*targs, causal=True, return_lse=True, **tkw)
            want_o, want_lse = _uncached(*targs, causal=True, return_lse=True, **tkw)
        side.synchronize()
        assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16
        assert torch.equal(o.view(torch.int16), want_o.view(torch.int16)) and torch.equal(lse, want_lse)
    assert plan_cache.stats()["hits"] - hits == 2


def test_cached_torch_checks_and_out():
    # A planned torch geometry: out= (a contiguous tensor, NaN-poisoned) is written in place and
    # equals the uncached result; an out-of-range kv_lens raises; a CPU tensor geometry is never
    # planned (the NumPy backend runs it).
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(61)
    args, kw, _ = _case(rng, SHAPES["cluster-split"], BFLOAT16, "lens")
    cupy.cuda.Device().synchronize()
    targs = [torch.from_dlpack(a) for a in args]
    lens = torch.from_dlpack(kw["kv_lens"])
    for _ in range(2):
        cuflash.attention(*targs, kv_lens=lens)
    assert plan_cache.stats()["plans"] == 1
    hits = plan_cache.stats()["hits"]
    out = torch.full_like(targs[0], float("nan"))
    o = cuflash.attention(*targs, kv_lens=lens, out=out)
    assert o is out and plan_cache.stats()["hits"] == hits + 1
    want = _uncached(*targs, kv_lens=lens)
    assert torch.equal(o.view(torch.int16), want.view(torch.int16))
    with pytest.raises(ValueError, match="^kv_lens: values must lie in"):
        cuflash.attention(*targs, kv_lens=lens + 10**6)
    with pytest.raises(ValueError, match="out: must not overlap input q"):
        cuflash.attention(*targs, kv_lens=lens, out=targs[0])
    cpu = [t.cpu() for t in targs]
    plans = plan_cache.stats()["plans"]
    for _ in range(3):
        cuflash.attention(*cpu)
    assert plan_cache.stats()["plans"] == plans
