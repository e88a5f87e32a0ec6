"""Programmatic dependent launch (cuflash/pdl.py) on the device: the dependent kernel starts while
the one before it still runs, once that one's blocks have all called launch_dependents, and work
after the dependent on the stream still sees everything the first kernel wrote."""

from __future__ import annotations

import numpy as np
import pytest

from cuflash.kernels import pdl

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

SOURCE = r"""
// The primary spins until the dependent has recorded its start (times[1], zeroed before) or
// spin_ns have passed: a dependent that can start early ends the spin, one that cannot (an
// ordinary launch) starts only after the full spin. (A fixed 2 ms spin raced the host: a busy CPU
// could submit the dependent after the primary had already ended.)
extern "C" __global__ void primary(unsigned long long spin_ns, unsigned long long* times, int* flag) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); }
    while (t - t0 < spin_ns && *(volatile unsigned long long*)&times[1] == 0ull);
    t0 = t;  // 10 us more, so that the end's timestamp is past the start's at any timer resolution
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < 10000ull);
    *flag = 1;
    __threadfence();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    times[0] = t;  // when the primary ended
}
extern "C" __global__ void dependent(unsigned long long* times, int wait) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    times[1] = t;  // when the dependent started
    if (wait) asm volatile("griddepcontrol.wait;" ::: "memory");
}
extern "C" __global__ void after(const int* flag, int* seen) { *seen = *(volatile const int*)flag; }
"""


@pytest.fixture
def kernels():
    if not pdl.available():
        pytest.skip("programmatic dependent launch needs sm_90 and cuda-bindings")
    mod = cupy.RawModule(code=SOURCE, options=("-arch=sm_90",))
    return (mod.get_function(n) for n in ("primary", "dependent", "after"))


@pytest.mark.parametrize("wait", [0, 1])
def test_dependent_starts_before_the_primary_ends(kernels, wait):
    primary, dependent, after = kernels
    times = cupy.zeros(2, dtype=np.uint64)
    flag = cupy.zeros(1, dtype=np.int32)
    seen = cupy.full(1, -1, dtype=np.int32)
    primary((1,), (32,), (np.uint64(2_000_000_000), times, flag))  # until the dependent starts, at most 2 s
    pdl.launch(dependent, (1,), (32,), (times, np.int32(wait)))
    after((1,), (1,), (flag, seen))
    cupy.cuda.Device().synchronize()
    end, start = (int(x) for x in times.get())
    assert start < end, "the dependent kernel did not start before the primary ended"
    assert int(seen.get()[0]) == 1, "work after the dependent ran before the primary finished"


def test_fallback_is_an_ordinary_launch(kernels, monkeypatch):
    primary, dependent, _ = kernels
    monkeypatch.setattr(pdl, "_ENABLED", False)
    times = cupy.zeros(2, dtype=np.uint64)
    flag = cupy.zeros(1, dtype=np.int32)
    primary((1,), (32,), (np.uint64(200_000), times, flag))
    pdl.launch(dependent, (1,), (32,), (times, np.int32(0)))
    cupy.cuda.Device().synchronize()
    end, start = (int(x) for x in times.get())
    assert start >= end
