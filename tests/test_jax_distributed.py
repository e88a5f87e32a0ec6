"""cuflash.jax_distributed.ring_attention inside jax.shard_map on several CPU devices (a process of
its own per device count: tests/_jax_ring_worker.py), forward and backward against the float64
reference by the accuracy rule; and its argument checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("jax.experimental.buffer_callback")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from cuflash import jax_distributed as jd  # noqa: E402

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_and_allgather_on_cpu_devices(rng, world):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={world}", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]))
    seed = int(rng.integers(2**31))
    run = subprocess.run([sys.executable, str(HERE / "_jax_ring_worker.py"), str(world), str(seed)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"seed {seed}:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    assert f"on {world} devices" in run.stdout


def _one_device(fn, spec=P(None, None, "sp", None)):
    mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
    return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)


def test_argument_errors_name_the_argument():
    x = jnp.zeros((1, 2, 8, 16), jnp.float32)
    with pytest.raises(ValueError, match="axis_name"):
        jd.ring_attention(x, x, x, axis_name="sp")  # outside shard_map
    for kwargs, match in ((dict(mode="tree"), "mode"), (dict(balance="random"), "balance"),
                          (dict(causal="top_left"), "causal"), (dict(layout="sbhd"), "layout")):
        with pytest.raises(ValueError, match=match):
            _one_device(lambda q, k, v, kw=kwargs: jd.ring_attention(q, k, v, axis_name="sp", **kw))(x, x, x)
    with pytest.raises(ValueError, match="q: expected a 4-D"):
        jd.ring_attention(x[0], x[0], x[0], axis_name="sp")
    odd = jnp.zeros((1, 2, 7, 16), jnp.float32)
    with pytest.raises(ValueError, match="q: 7 rows per device"):
        _one_device(lambda q, k, v: jd.ring_attention(q, k, v, axis_name="sp"))(odd, odd, odd)
    with pytest.raises(ValueError, match="x: a sequence of 7 rows"):
        jd.to_ring_order(odd, 1)
    with pytest.raises(TypeError, match="dtype"):
        i = jnp.zeros((1, 2, 8, 16), jnp.int32)
        _one_device(lambda q, k, v: jd.ring_attention(q, k, v, axis_name="sp"))(i, i, i)


def test_ring_order_round_trip():
    x = jnp.arange(24).reshape(1, 1, 24, 1)
    z = jd.to_ring_order(x, 3)  # chunks of 4: devices get (0, 5), (1, 4), (2, 3)
    assert np.asarray(z).ravel().tolist() == [0, 1, 2, 3, 20, 21, 22, 23, 4, 5, 6, 7, 16, 17, 18, 19,
                                              8, 9, 10, 11, 12, 13, 14, 15]
    assert np.array_equal(np.asarray(jd.from_ring_order(z, 3)), np.asarray(x))
    c = jd.to_ring_order(x, 3, balance="contiguous")
    assert np.array_equal(np.asarray(c), np.asarray(x))


def test_import_cuflash_does_not_import_jax_distributed():
    code = "import sys, cuflash; assert 'cuflash.jax_distributed' not in sys.modules and 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
