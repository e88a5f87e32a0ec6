"""cuflash.api.plan_cache without a GPU: which calls get a key, when a plan is made, what is kept.
(The plans' results against the uncached path: tests/test_gpu_plan_cache.py.)"""

import sys
import types

import numpy as np
import pytest

import cuflash
from cuflash.api import plan_cache


class _FakeArray:
    """Stands in for cupy.ndarray: what a key reads."""

    def __init__(self, shape, dtype=np.float16, device=0):
        self.shape = shape
        self.strides = tuple(int(np.prod(shape[i + 1:])) * 2 for i in range(len(shape)))
        self.dtype = np.dtype(dtype)
        self.data = types.SimpleNamespace(device_id=device)


@pytest.fixture
def fake_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(ndarray=_FakeArray))
    monkeypatch.setattr(plan_cache, "enabled", True)
    plan_cache.clear()
    yield
    plan_cache.clear()


OPTS = (False, None, "bhsd", False, True, None)  # causal, scale, layout, return_lse, validate, window


def _qkv(nk=512, device=0):
    return _FakeArray((2, 8, 1, 64), device=device), _FakeArray((2, 2, nk, 64), device=device), \
        _FakeArray((2, 2, nk, 64), device=device)


def test_keys_tell_apart_what_validation_tells_apart(fake_cupy):
    q, k, v = _qkv()
    key = plan_cache._key(q, k, v, None, None, OPTS)
    assert key is not None and key == plan_cache._key(*_qkv(), None, None, OPTS)
    others = [
        plan_cache._key(*_qkv(nk=513), None, None, OPTS),
        plan_cache._key(*_qkv(device=1), None, None, OPTS),
        plan_cache._key(q, k, v, _FakeArray((2,), np.int32), None, OPTS),
        plan_cache._key(q, k, v, None, None, (True, None, "bhsd", False, True, None)),
        plan_cache._key(q, k, v, None, None, (1, None, "bhsd", False, True, None)),  # 1 == True, not the same call
        plan_cache._key(q, k, v, None, None, (False, 1, "bhsd", False, True, None)),
        plan_cache._key(q, k, v, None, None, (False, True, "bhsd", False, True, None)),
        plan_cache._key(q, k, v, None, None, (False, None, "bhsd", False, True, (4, 0))),
    ]
    assert None not in others and len({key, *others}) == len(others) + 1
    # No key: another kind of array, an unhashable or not plainly typed option.
    assert plan_cache._key(np.zeros((2, 8, 1, 64), np.float16), k, v, None, None, OPTS) is None
    assert plan_cache._key(q, np.zeros((2, 2, 512, 64), np.float16), v, None, None, OPTS) is None
    assert plan_cache._key(q, k, v, None, None, (False, None, "bhsd", False, True, [4, 0])) is None
    assert plan_cache._key(q, k, v, None, None, (False, None, "bhsd", False, True, (np.int64(4), 0))) is None
    assert plan_cache._key(q, k, v, None, None, (False, [1.0], "bhsd", False, True, None)) is None


def _kv8(nk=512, device=0):
    """An FP8 KV cache's arrays as the key reads them: a 16-bit q, e4m3 bits (uint8) for k and v."""
    return _FakeArray((2, 8, 1, 64), device=device), _FakeArray((2, 2, nk, 64), np.uint8, device), \
        _FakeArray((2, 2, nk, 64), np.uint8, device)


def _strided(shape, strides, dtype=np.float32, device=0):
    a = _FakeArray(shape, dtype, device)
    a.strides = strides
    return a


def test_keys_tell_apart_descale_geometries(fake_cupy):
    # An FP8 KV cache's descales are part of the key: per tensor, per (sequence, K/V head), other
    # strides, dtypes or devices, and given or not, are different geometries; their values are not.
    q, k, v = _kv8()
    per_tensor = (_FakeArray((), np.float32), _FakeArray((), np.float32))
    key = plan_cache._key(q, k, v, None, None, OPTS, per_tensor)
    assert key is not None and key == plan_cache._key(*_kv8(), None, None, OPTS,
                                                       (_FakeArray((), np.float32), _FakeArray((), np.float32)))
    others = [
        plan_cache._key(q, k, v, None, None, OPTS),  # no descales
        plan_cache._key(q, k, v, None, None, OPTS, (per_tensor[0], None)),
        plan_cache._key(q, k, v, None, None, OPTS, (None, per_tensor[1])),
        plan_cache._key(q, k, v, None, None, OPTS, (_FakeArray((1,), np.float32), per_tensor[1])),
        plan_cache._key(q, k, v, None, None, OPTS, (per_tensor[0], _FakeArray((1,), np.float32))),
        plan_cache._key(q, k, v, None, None, OPTS, (_FakeArray((2, 2), np.float32), _FakeArray((2, 2), np.float32))),
        plan_cache._key(q, k, v, None, None, OPTS, (_strided((2, 2), (4, 8)), _FakeArray((2, 2), np.float32))),
        plan_cache._key(q, k, v, None, None, OPTS, (_FakeArray((2, 2), np.float32), _strided((2, 2), (4, 8)))),
        plan_cache._key(q, k, v, None, None, OPTS, (_FakeArray((), np.float64), per_tensor[1])),
        plan_cache._key(q, k, v, None, None, OPTS, (per_tensor[0], _FakeArray((), np.float32, device=1))),
    ]
    assert None not in others and len({key, *others}) == len(others) + 1
    # A descale of another kind than q: no key (the uncached path names it).
    assert plan_cache._key(q, k, v, None, None, OPTS, (np.ones((), np.float32), per_tensor[1])) is None


def test_an_fp8_cache_geometry_is_planned_with_its_descales(fake_cupy, monkeypatch):
    # The descales reach the preparation and every call of the plan; a call with descales of
    # another geometry is another key (a first sighting: not run from the plan).
    made, calls = [], []

    def plan(arrays, out):
        calls.append((arrays["k_descale"], arrays["v_descale"]))
        return "result"

    def prepare(q, k, v, kv_lens, block_table, options, descales):
        made.append(descales)
        return plan

    monkeypatch.setattr(plan_cache, "_prepare", prepare)
    hits = plan_cache.stats()["hits"]
    sets = [(_FakeArray((2, 2), np.float32), _FakeArray((2, 2), np.float32)) for _ in range(4)]
    assert plan_cache.run(*_kv8(), None, None, None, OPTS, sets[0]) is plan_cache.MISS
    for d in sets[1:]:
        assert plan_cache.run(*_kv8(), None, None, None, OPTS, d) == "result"
    assert made == [sets[1]] and calls == sets[1:]
    assert plan_cache.stats()["hits"] - hits == 3
    other = (_FakeArray((), np.float32), _FakeArray((), np.float32))
    assert plan_cache.run(*_kv8(), None, None, None, OPTS, other) is plan_cache.MISS
    assert len(made) == 1 and plan_cache.stats()["hits"] - hits == 3


def test_a_geometry_is_planned_on_its_second_call_and_kept(fake_cupy, monkeypatch):
    made, calls = [], []

    def plan(arrays, out):
        calls.append(arrays["k"].shape)
        return "result"

    def prepare(q, k, v, kv_lens, block_table, options, descales):
        made.append(k.shape)
        return plan

    monkeypatch.setattr(plan_cache, "_prepare", prepare)
    before = plan_cache.stats()
    assert plan_cache.run(*_qkv(), None, None, None, OPTS) is plan_cache.MISS  # first sighting
    assert made == []
    for _ in range(3):
        assert plan_cache.run(*_qkv(), None, None, None, OPTS) == "result"
    assert len(made) == 1 and len(calls) == 3
    after = plan_cache.stats()
    assert (after["hits"] - before["hits"], after["prepared"] - before["prepared"], after["plans"]) == (3, 1, 1)
    with plan_cache.disabled():
        assert plan_cache.run(*_qkv(), None, None, None, OPTS) is plan_cache.MISS
    assert plan_cache.run(*_qkv(), None, None, None, OPTS) == "result"


def test_rejected_and_non_decode_calls(fake_cupy, monkeypatch):
    # A call the plan rejects (None: invalid values) is not cached; a plan that is not the decode
    # path is kept as such; a plan's None (e.g. an unaligned K) runs the uncached path.
    outcome = {"n": 1}
    monkeypatch.setattr(plan_cache, "_prepare", lambda *a: None)
    for _ in range(3):
        assert plan_cache.run(*_qkv(nk=300), None, None, None, OPTS) is plan_cache.MISS
    assert plan_cache.stats()["plans"] == 0
    monkeypatch.setattr(plan_cache, "_prepare", lambda *a: plan_cache._NOT_DECODE)
    for _ in range(3):
        assert plan_cache.run(*_qkv(nk=301), None, None, None, OPTS) is plan_cache.MISS
    assert plan_cache.stats()["plans"] == 0 and len(plan_cache._plans) == 1

    def plan(arrays, out):
        outcome["n"] += 1
        return None

    monkeypatch.setattr(plan_cache, "_prepare", lambda *a: plan)
    for _ in range(3):
        assert plan_cache.run(*_qkv(nk=302), None, None, None, OPTS) is plan_cache.MISS
    assert outcome["n"] == 3  # called on the second and third sightings


def test_plans_and_sightings_are_bounded(fake_cupy, monkeypatch):
    monkeypatch.setattr(plan_cache, "_prepare", lambda *a: (lambda arrays, out: "r"))
    for n in range(plan_cache.MAX_PLANS + 5):
        for _ in range(2):
            plan_cache.run(*_qkv(nk=1000 + n), None, None, None, OPTS)
    assert len(plan_cache._plans) == plan_cache.MAX_PLANS
    newest = plan_cache._key(*_qkv(nk=1000 + plan_cache.MAX_PLANS + 4), None, None, OPTS)
    oldest = plan_cache._key(*_qkv(nk=1000), None, None, OPTS)
    assert newest in plan_cache._plans and oldest not in plan_cache._plans
    for n in range(plan_cache.MAX_SEEN + 10):  # a growing cache: every call a new geometry
        assert plan_cache.run(*_qkv(nk=5000 + n), None, None, None, OPTS) is plan_cache.MISS
    assert len(plan_cache._seen) == plan_cache.MAX_SEEN


def test_numpy_calls_are_never_planned(fake_cupy):
    # With a CuPy module loaded (the stand-in), NumPy calls pass through untouched: no key, no
    # count, no plan, and the same result as with the cache off.
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 1, 16)).astype(np.float32)
    k = rng.standard_normal((1, 2, 40, 16)).astype(np.float32)
    assert plan_cache._key(q, k, k, None, None, OPTS) is None
    before = plan_cache.stats()
    with plan_cache.disabled():
        want = cuflash.attention(q, k, k)
    for _ in range(3):
        np.testing.assert_array_equal(cuflash.attention(q, k, k), want)
    assert plan_cache.stats() == before and not plan_cache._plans and not plan_cache._seen


def test_a_failing_prepare_leaves_the_geometry_uncached(fake_cupy, monkeypatch):
    # Invalid values (ValueError) are not remembered: a later valid call may still be planned. Any
    # other failure while preparing leaves the geometry to the uncached path for good, so that the
    # public call never fails where the uncached path would run.
    from cuflash.api import prepared

    def broken(*a, **k):
        raise RuntimeError("a bug in preparing")

    monkeypatch.setattr(plan_cache, "PreparedAttention", broken)
    for _ in range(4):
        assert plan_cache.run(*_qkv(nk=777), None, None, None, OPTS) is plan_cache.MISS
    key = plan_cache._key(*_qkv(nk=777), None, None, OPTS)
    assert plan_cache._plans[key] is plan_cache._NOT_DECODE

    def invalid(*a, **k):
        raise ValueError("kv_lens: values must lie in ...")

    monkeypatch.setattr(plan_cache, "PreparedAttention", invalid)
    for _ in range(4):
        assert plan_cache.run(*_qkv(nk=778), None, None, None, OPTS) is plan_cache.MISS
    assert plan_cache._key(*_qkv(nk=778), None, None, OPTS) not in plan_cache._plans


def test_which_fp8_calls_consult_the_cache(fake_cupy, monkeypatch):
    # An FP8 KV cache's call (descales given, or none) asks the cache with its descales; an FP8 call
    # with q_descale, out_dtype, packed sequences or score modifiers goes straight to the uncached
    # path, as does a miss.
    from cuflash.api import functional

    asked, uncached = [], []

    def run(q, k, v, kv_lens, block_table, out, options, descales=(None, None)):
        asked.append((options, descales))
        return "planned" if len(asked) % 2 else plan_cache.MISS

    monkeypatch.setattr(plan_cache, "run", run)
    monkeypatch.setattr(functional, "_attention_fp8", lambda *a, **k: uncached.append(a) or "uncached")
    q, k, v = _kv8()
    kd, vd = _FakeArray((2, 2), np.float32), _FakeArray((), np.float32)
    assert cuflash.attention(q, k, v, k_descale=kd, v_descale=vd, causal=True, window=(8, 0)) == "planned"
    assert asked[-1] == ((True, None, "bhsd", False, True, (8, 0)), (kd, vd))
    assert cuflash.attention(q, k, v, v_descale=vd) == "uncached"  # (a miss)
    assert asked[-1][1] == (None, vd) and len(uncached) == 1
    n = len(asked)
    for extra in (dict(q_descale=vd), dict(out_dtype=np.float16), dict(softcap=5.0), dict(max_seqlen_q=3),
                  dict(cu_seqlens_q=_FakeArray((3,), np.int32), cu_seqlens_k=_FakeArray((3,), np.int32))):
        assert cuflash.attention(q, k, v, k_descale=kd, v_descale=vd, **extra) == "uncached"
    assert len(asked) == n and len(uncached) == 6


def test_numpy_fp8_calls_are_never_planned(fake_cupy):
    # NumPy e4m3 caches (the NumPy backend) get no key, no count and no plan.
    from cuflash import fp8

    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 1, 16)).astype(np.float16)
    k8 = fp8.to_e4m3(rng.standard_normal((1, 2, 40, 16)) * 10)
    kd = np.full((1, 2), 0.1, np.float32)
    assert plan_cache._key(q, k8, k8, None, None, OPTS, (kd, kd)) is None
    before = plan_cache.stats()
    with plan_cache.disabled():
        want = cuflash.attention(q, k8, k8, k_descale=kd, v_descale=kd)
    for _ in range(3):
        np.testing.assert_array_equal(cuflash.attention(q, k8, k8, k_descale=kd, v_descale=kd).view(np.uint16),
                                      want.view(np.uint16))
    assert plan_cache.stats() == before and not plan_cache._plans and not plan_cache._seen
