"""The body of tests/test_jax_distributed.py, run in a process of its own: JAX fixes its number of
CPU devices when it starts, so the test launches this with XLA_FLAGS asking for several.

    python tests/_jax_ring_worker.py WORLD SEED

Runs every case of cases(WORLD) through cuflash.jax_distributed.ring_attention inside
jax.shard_map on WORLD CPU devices, forward and backward (jax.vjp), reassembles the results and
checks them against the float64 reference by the accuracy rule (_cp_cases.check_case); then
cuflash.jax.attention inside shard_map (per-device blocks, a psum of its results, gradients).
Exits non-zero on the first failure."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from _cp_cases import NUMPY, check_case
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import cuflash.jax as cfjax
from cuflash import jax_distributed as jd
from cuflash.testing import reference64_backward


def cases(world, seed):
    base = dict(b=1, d=16, layout="bhsd", balance="zigzag", mode="ring")
    out = [
        dict(base, hq=2, hkv=2, n=4 * world, dtype="float32", causal=True),
        dict(base, hq=2, hkv=2, n=6 * world, dtype="bfloat16", causal=True, layout="bshd"),
        dict(base, hq=2, hkv=2, n=4 * world, dtype="float16", causal=False),
        dict(base, hq=4, hkv=2, n=4 * world, dtype="bfloat16", causal=True, b=2),  # GQA on the ring
        dict(base, hq=4, hkv=1, n=4 * world, dtype="float32", causal=True, mode="auto"),  # MQA: all-gather
        dict(base, hq=4, hkv=2, n=2 * world, dtype="float16", causal=False, mode="allgather", layout="bshd"),
        dict(base, hq=2, hkv=1, n=3 * world, dtype="float32", causal=False, balance="contiguous"),
        dict(base, hq=2, hkv=2, n=5 * world, dtype="bfloat16", causal=True, balance="contiguous", mode="allgather"),
        dict(base, hq=4, hkv=2, n=4 * world, dtype="float16", causal=True, dv=8),  # v narrower than q, k
    ]
    for i, c in enumerate(out):
        c["seed"] = seed + i
    return out


def inputs(case):
    rng = np.random.default_rng(case["seed"])
    b, hq, hkv, n, d = case["b"], case["hq"], case["hkv"], case["n"], case["d"]
    dv = case.get("dv", d)  # v's (and o's) head dim
    sq, skv = ((b, hq, n, d), (b, hkv, n, d)) if case["layout"] == "bhsd" else ((b, n, hq, d), (b, n, hkv, d))
    dt = NUMPY[case["dtype"]]
    return [rng.standard_normal(s).astype(np.float32).astype(dt) for s in (sq, skv, skv[:-1] + (dv,), sq[:-1] + (dv,))]


def run_case(case, mesh, world):
    layout, balance = case["layout"], case["balance"]
    ax = 2 if layout == "bhsd" else 1
    spec = P(None, None, "sp", None) if layout == "bhsd" else P(None, "sp", None, None)

    def body(q, k, v):
        return jd.ring_attention(q, k, v, axis_name="sp", causal=case["causal"], layout=layout, mode=case["mode"],
                                 balance=balance, return_lse=True)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, P(None, None, "sp"))))
    q, k, v, do = inputs(case)

    def order(x, axis=ax):
        return jd.to_ring_order(jnp.asarray(x), world, balance=balance, axis=axis)

    def back(x, axis=ax):
        return np.asarray(jd.from_ring_order(x, world, balance=balance, axis=axis).astype(jnp.float32))

    (o, lse), vjp = jax.vjp(fn, order(q), order(k), order(v))
    assert o.dtype == q.dtype and lse.dtype == jnp.float32, (o.dtype, lse.dtype)
    grads = vjp((order(do), jnp.zeros(lse.shape, jnp.float32)))
    assert all(g.dtype == x.dtype for g, x in zip(grads, (q, k, v)))
    check_case(case, world, [q, k, v, do], [back(o), back(lse, 2)] + [back(g) for g in grads])


def check_adapter_in_shard_map(mesh, world, seed):
    """cuflash.jax.attention per device block inside shard_map: a psum of its results, and its
    gradients (custom_vjp refuses gradients typed unlike their varying primals)."""
    rng = np.random.default_rng(seed)
    n = 8 * world
    q, k, v, do = (rng.standard_normal((1, 2, n, 16)).astype(np.float32) for _ in range(4))
    spec = P(None, None, "sp", None)

    def body(q, k, v):
        o = cfjax.attention(q, k, v, causal=True)
        return o, jax.lax.psum(jnp.sum(o), "sp")

    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, P()))
    (o, total), vjp = jax.vjp(fn, q, k, v)
    assert np.allclose(float(total), float(jnp.sum(o)), rtol=1e-5), (float(total), float(jnp.sum(o)))
    grads = vjp((jnp.asarray(do), jnp.zeros((), jnp.float32)))
    for blk in range(world):  # device blk's block attends to itself only
        sl = slice(8 * blk, 8 * blk + 8)
        want = reference64_backward(do[:, :, sl], q[:, :, sl], k[:, :, sl], v[:, :, sl], causal=True)
        for g, w in zip(grads, want):
            err = np.abs(np.asarray(g)[:, :, sl] - w).max()
            assert err < 1e-5 * max(1.0, np.abs(w).max()), err


def main():
    world, seed = int(sys.argv[1]), int(sys.argv[2])
    devices = jax.devices("cpu")
    if len(devices) < world:
        raise SystemExit(f"needs {world} CPU devices, JAX has {len(devices)} (XLA_FLAGS)")
    mesh = Mesh(np.array(devices[:world]), ("sp",))
    for case in cases(world, seed):
        run_case(case, mesh, world)
    check_adapter_in_shard_map(mesh, world, seed)
    print(f"ok: {len(cases(world, seed))} cases on {world} devices")


if __name__ == "__main__":
    main()
