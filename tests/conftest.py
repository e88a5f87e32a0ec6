"""Shared test machinery: the ``gpu`` marker's skip rule and a freshly seeded ``rng`` per test."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import types

import numpy as np
import pytest
from cuflash.plan import hopper as plan_hopper

@pytest.fixture
def fake_cupy(monkeypatch):
    """A stand-in cupy module (routing tests without a GPU): the routing enters cupy.cuda.Device(n) and nothing else."""
    mod = types.ModuleType("cupy")
    mod.cuda = types.SimpleNamespace(Device=lambda n: contextlib.nullcontext())
    monkeypatch.setitem(sys.modules, "cupy", mod)
    return mod


_SEED_ENV = "CUFLASH_SEED"  # set to replay a failing test with the seed it printed


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason() -> str | None:
    """None when CuPy imports and sees at least one device, else why the GPU tests skip."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install raising on import
        return f"cupy is not importable ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver / no device raises CUDARuntimeError
        return f"no CUDA device ({type(exc).__name__}: {exc})"
    if count == 0:
        return "no CUDA device (getDeviceCount() == 0)"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu: {reason}")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A numpy Generator with a fresh seed for every test; the seed is reported on failure."""
    env = os.environ.get(_SEED_ENV)
    seed = int(env) if env else int(np.random.SeedSequence().entropy % 2**63)
    request.node._cuflash_seed = seed
    request.node.user_properties.append(("rng_seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = getattr(item, "_cuflash_seed", None)
    if seed is not None and report.failed:
        report.sections.append(
            ("rng seed", f"rng seed {seed}: replay with {_SEED_ENV}={seed} python -m pytest '{item.nodeid}'")
        )


@pytest.fixture(params=["auto", "mma_sync"])
def kernels(request, monkeypatch):
    """Both kernel families: on a Hopper GPU "auto" runs the wgmma kernels where they apply and
    "mma_sync" forces the fallback, so neither goes untested; elsewhere the two coincide."""

    monkeypatch.setenv(plan_hopper.ENV, request.param)
    return request.param


@pytest.fixture(autouse=True)
def _fresh_plan_cache():
    """Each test starts without cuflash.attention's decode plans (cuflash.api.plan_cache): a plan made
    in an earlier test would keep the planner choices of that test (monkeypatched tables, kernel
    selection) for a later test's calls of the same geometry."""
    from cuflash.api import plan_cache

    plan_cache.clear()
    yield
