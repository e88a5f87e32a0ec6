"""cuflash.jax_distributed.ring_attention on one GPU (a one-device mesh): every step's callbacks on
the GPU (the float32-epilogue forward, the float32 backward on widened inputs) and every chunk
pair case of the traced lax.switch (full, causal diagonal, empty), against the float64 reference
by the accuracy rule, as tests/test_jax_distributed.py does on several CPU devices."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("jax.experimental.buffer_callback")
pytestmark = pytest.mark.gpu

from jax.sharding import Mesh  # noqa: E402

import _jax_ring_worker as worker  # noqa: E402


def _gpu_mesh():
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        pytest.skip("JAX sees no GPU")
    return Mesh(np.array(gpus[:1]), ("sp",))


def test_every_case_on_a_one_device_gpu_mesh(rng):
    mesh = _gpu_mesh()
    with jax.default_device(mesh.devices.flat[0]):
        for case in worker.cases(1, int(rng.integers(2**31))):
            worker.run_case(case, mesh, 1)
