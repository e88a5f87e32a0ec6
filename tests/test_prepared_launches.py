"""Prepared and cached decode calls launch what the uncached path launches, argument for argument,
without a GPU: CuPy replaced by a NumPy-backed stand-in (tests/_numpy_cupy.py) and the launches
recorded (CuPy's kernel call for the uncached path, the packed parameter block's slots for the
prepared one). For 16-bit and e4m3 (FP8) K/V caches: same kernels, grids, blocks and shared
memory; every scalar equal; every pointer to an input (q, k, v, kv_lens, block_table, the
descales, a missing descale's unit factor) equal, outputs and workspaces allocated on both sides.
(The results on the device: tests/test_gpu_prepared.py, tests/test_gpu_prepared_fp8_cache.py.)"""

import numpy as np
import pytest

import cuflash
from cuflash.api import fp8_checks, plan_cache, prepared
from cuflash.core.arrays import BFLOAT16, FLOAT16
from cuflash.kernels import build, counters, device, packed_launch, pdl
from cuflash.kernels import decode as decode_kernels
from cuflash.plan import decode as plan_decode

import _numpy_cupy

_FINITE = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
_COUNTERS = 0x777000  # the split counters' address on both paths (stubbed)


@pytest.fixture
def launches(monkeypatch):
    """The stand-in CuPy, 132 SMs of sm_90, and the list of launches made: (path, kernel, grid,
    block, shared memory, [("ptr" | "val", value) per parameter])."""
    cupy = _numpy_cupy.install(monkeypatch)
    fp8_checks.device_scalar.cache_clear()  # (no real device scalar in, no stand-in out)
    monkeypatch.setattr(device, "sm_count", lambda dev: 132)
    monkeypatch.setattr(device, "compute_capability", lambda dev: 90)
    monkeypatch.setattr(pdl, "available", lambda: False)
    log = []

    def pad(t):
        return tuple(int(x) for x in t) + (1,) * (3 - len(t))

    class Function:
        def __init__(self, spec):
            self.name = spec.short_name
            self.kernel = type("Kernel", (), {"ptr": 1})()

        def __call__(self, grid, block, args, shared_mem=0):
            log.append(("uncached", self.name, pad(grid), pad(block), shared_mem,
                        [("ptr", a.data.ptr) if isinstance(a, cupy.ndarray) else ("val", packed_launch._slot_value(a))
                         for a in args]))

    def launch(self, stream, *pointers):
        assert len(pointers) == len(self._pointer_slots)
        slots = list(self._slots)
        for i, ptr in zip(self._pointer_slots, pointers):
            slots[i] = ptr
        log.append(("packed", self.name, self._dims[:3], self._dims[3:6], self._dims[6],
                    [("ptr" if i in self._pointer_slots else "val", v) for i, v in enumerate(slots)]))

    for module in (build, decode_kernels, prepared):
        monkeypatch.setattr(module, "get_function", Function)
    monkeypatch.setattr(counters, "zeroed", lambda n, stream, fresh=None: _COUNTERS)
    monkeypatch.setattr(counters, "for_cupy_launch", lambda n, dtype="int32": (_COUNTERS, None))
    monkeypatch.setattr(packed_launch.PackedLaunch, "launch", launch)
    monkeypatch.setattr(plan_cache, "enabled", True)
    plan_cache.clear()
    yield cupy, log
    plan_cache.clear()
    fp8_checks.device_scalar.cache_clear()


def _same_launch(tag, prepared_launch, uncached_launch, inputs):
    _, name_a, grid_a, block_a, smem_a, args_a = prepared_launch
    _, name_b, grid_b, block_b, smem_b, args_b = uncached_launch
    assert (name_a, grid_a, block_a, smem_a) == (name_b, grid_b, block_b, smem_b), tag
    assert len(args_a) == len(args_b), tag
    for i, (a, b) in enumerate(zip(args_a, args_b)):
        if a[0] == b[0] == "val" or a[1] in inputs or b[1] in inputs:
            assert a == b, (tag, i, a, b)
        else:  # an output or workspace (the counters' address is a value on the uncached path), or null
            assert (a[1] == 0) == (b[1] == 0), (tag, i, a, b)


# (b, hq, hkv, nq, nk, d)
SHAPES = {"cluster": (2, 8, 2, 1, 1500, 128), "workspace": (1, 4, 4, 1, 40000, 128), "pairs": (40, 16, 4, 1, 600, 64),
          "gqa-5": (3, 16, 4, 5, 2000, 128), "d256": (2, 4, 4, 1, 1024, 256)}


def _call(cupy, rng, shape, dtype, e4m3, kind, granularity, layout="bhsd"):
    """Fresh arrays of one geometry: q in dtype, k and v e4m3 bits (uint8) or dtype, descales by
    granularity (None: none). Values are never read but kv_lens' and block_table's."""
    b, hq, hkv, nq, nk, d = shape
    qs, kvs = ((b, hq, nq, d), (b, hkv, nk, d)) if layout == "bhsd" else ((b, nq, hq, d), (b, nk, hkv, d))
    q = cupy.zeros(qs, dtype)
    kv_dtype = np.uint8 if e4m3 else dtype
    kw = {}
    if granularity == "per-head":
        kw = dict(k_descale=cupy.full((b, hkv), 0.5), v_descale=cupy.full((b, hkv), 0.25))
    elif granularity == "per-tensor":
        kw = dict(k_descale=cupy.full((), 0.5), v_descale=cupy.full((), 0.25))
    elif granularity == "k-only":  # (v's factor: 1, the unit descale)
        kw = dict(k_descale=cupy.full((1,), 0.5))
    elif granularity == "mixed":  # (attention copies both into one (B, Hkv) form)
        kw = dict(k_descale=cupy.full((b, hkv), 0.5), v_descale=cupy.full((), 0.25))
    lens = cupy.asarray(rng.integers(1, nk + 1, size=b).astype(np.int32))
    if kind == "paged":
        per = -(-nk // 64)
        blocks = b * per + 3
        k, v = (cupy.zeros((blocks, 64, hkv, d), kv_dtype) for _ in "kv")
        table = cupy.asarray(rng.permutation(blocks)[: b * per].reshape(b, per).astype(np.int32))
        kw.update(kv_lens=lens, block_table=table)
    else:
        k, v = (cupy.zeros(kvs, kv_dtype) for _ in "kv")
        if kind == "lens":
            kw["kv_lens"] = lens
    return (q, k, v), kw


CASES = [("plain", "per-tensor", {}), ("lens", "per-head", dict(causal=True, return_lse=True)),
         ("lens", "per-tensor", dict(causal=True, window=(333, 0))), ("lens", "k-only", dict(causal=True)),
         ("paged", "per-tensor", dict(causal=True)), ("paged", "per-tensor", dict(validate=False))]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind,granularity,opts", CASES, ids=[f"{k}-{g}-{len(o)}" for k, g, o in CASES])
@pytest.mark.parametrize("merge", ["auto", "kernel"])
def test_e4m3_cache_launches_as_uncached(launches, monkeypatch, shape, kind, granularity, opts, merge):
    cupy, log = launches
    monkeypatch.setattr(plan_decode, "MERGE", merge)
    _check_paths(cupy, log, lambda rng: _call(cupy, rng, SHAPES[shape], BFLOAT16, True, kind, granularity), opts,
                 kv8=True)


@pytest.mark.parametrize("dtype,e4m3,kind,granularity,opts,layout", [
    (BFLOAT16, True, "lens", "per-head", dict(causal=True), "bshd"),
    (FLOAT16, True, "lens", "per-head", {}, "bhsd"),
    (BFLOAT16, False, "lens", None, dict(causal=True, return_lse=True), "bhsd"),
    (FLOAT16, False, "paged", None, dict(window=(100, 0)), "bhsd"),
], ids=["e4m3-bshd", "e4m3-f16", "bf16-lens", "f16-paged"])
def test_other_forms_launch_as_uncached(launches, dtype, e4m3, kind, granularity, opts, layout):
    # "bshd" e4m3 caches, a float16 q with an e4m3 cache, and 16-bit caches (the same launch builder).
    cupy, log = launches
    _check_paths(cupy, log, lambda rng: _call(cupy, rng, SHAPES["gqa-5"], dtype, e4m3, kind, granularity, layout),
                 dict(opts, layout=layout), kv8=e4m3)


def _check_paths(cupy, log, make, opts, kv8):
    """Two prepared calls and three cuflash.attention calls (the second and third from the plan
    cache) of fresh arrays from make(rng), each against the uncached call on the same arrays."""
    rng = np.random.default_rng(5)
    args, kw = make(rng)
    run = cuflash.prepare_attention(*args, **opts, **kw)
    assert run.path == "decode" and ("_kv8<" in run.kernel[0]) == kv8, run

    def compare(call, expect, tag):
        args, kw = make(rng)
        inputs = {a.data.ptr for a in (*args, *kw.values())} | {fp8_checks.unit_descale(0).data.ptr}
        log.clear()
        call(*args, **kw)
        n = len(log)
        assert n and all(e[0] == expect for e in log), (tag, log)
        with plan_cache.disabled():
            cuflash.attention(*args, **opts, **kw)
        assert len(log) == 2 * n and all(e[0] == "uncached" for e in log[n:]), tag
        for a, b in zip(log[:n], log[n:]):
            _same_launch(tag, a, b, inputs)

    for trial in range(2):
        compare(run, "packed", f"prepared {trial}")
    hits = plan_cache.stats()["hits"]
    for index in range(3):
        compare(lambda *a, **k: cuflash.attention(*a, **opts, **k), "packed" if index else "uncached",
                f"cached {index}")
    assert plan_cache.stats()["hits"] - hits == 2


def test_descale_slots(launches):
    # Descales attention reads in place are the launch's own pointer slots, a missing one the unit
    # factor's constant address; those attention copies first (a per-tensor factor beside a
    # per-head one, per-head factors not in C order) take the "attention" path, and the plan cache
    # keeps no plan for them.
    cupy, log = launches
    rng = np.random.default_rng(7)
    shape = SHAPES["cluster"]
    for granularity, want in (("per-tensor", (None, None, 0, 0)), ("per-head", (None, None, 2, 1)),
                              ("k-only", (None, fp8_checks.unit_descale(0).data.ptr, 0, 0))):
        args, kw = _call(cupy, rng, shape, BFLOAT16, True, "lens", granularity)
        run = cuflash.prepare_attention(*args, **kw)
        assert run._decode.descales == want[:2], granularity
        log.clear()
        run(*args, **kw)
        given = [("ptr", kw[n].data.ptr) for n in ("k_descale", "v_descale") if n in kw]
        unit = [("ptr", want[1])] if granularity == "k-only" else []
        assert log[0][-1][-4:] == given + unit + [("val", want[2]), ("val", want[3])], granularity
    args, kw = _call(cupy, rng, shape, BFLOAT16, True, "lens", "mixed")
    assert cuflash.prepare_attention(*args, **kw).path == "attention"
    transposed = dict(kw, k_descale=cupy.asfortranarray(cupy.full((2, 2), 0.5)),
                      v_descale=cupy.asfortranarray(cupy.full((2, 2), 0.5)))
    assert cuflash.prepare_attention(*args, **transposed).path == "attention"
    for _ in range(3):
        cuflash.attention(*args, **kw)
    assert plan_cache.stats()["plans"] == 0 and len(plan_cache._plans) == 1  # (kept as not the decode path)
