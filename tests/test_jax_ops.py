"""cuflash.jax: every option under jit, grad and vmap, against cuflash's NumPy path and the float64 reference.

CPU arrays run the NumPy backend inside XLA's callbacks; the ``gpu``-marked tests repeat
jit(grad(loss)) on a JAX GPU device."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX must leave memory to CuPy's pool

import numpy as np
import pytest

import cuflash
from cuflash.core.arrays import BFLOAT16
from cuflash.testing import (assert_backward_accurate, assert_within_rule, faithful_backward_realizations,
                             random_array, random_inputs, reference64_backward)

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

cfj = pytest.importorskip("cuflash.jax")

DTYPES = [pytest.param(np.float32, id="f32"), pytest.param(np.float16, id="f16"), pytest.param(BFLOAT16, id="bf16")]


def bits(a):
    a = np.ascontiguousarray(np.asarray(a))
    return a.view({2: np.uint16, 4: np.uint32}[a.itemsize])


def same(a, b):
    a = np.asarray(a)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(bits(a), bits(b))


def _loss(opts, do):
    """sum(o * do) in float32: its gradient is the vjp of do."""
    return lambda a, b, c: jnp.sum(cfj.attention(a, b, c, **opts).astype(jnp.float32) * do.astype(jnp.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_jit_grad_window_against_reference(rng, dtype):
    """jit(grad(loss)) through a windowed causal GQA call: bit for bit cuflash's NumPy gradients,
    and within the project's rule of the float64 reference."""
    q, k, v = random_inputs(rng, (2, 4, 7, 8), (2, 2, 9, 8), dtype)
    do = random_array(rng, q.shape, dtype)
    opts = dict(causal="bottom_right", window=(3, -1), scale=0.5)
    grads = jax.jit(jax.grad(_loss(opts, jnp.asarray(do)), argnums=(0, 1, 2)))(*(jnp.asarray(a) for a in (q, k, v)))
    for g, w in zip(grads, cuflash.attention_vjp(q, k, v, **opts)[1](do)):
        assert same(g, w)
    refs = reference64_backward(do, q, k, v, **opts)
    yards = faithful_backward_realizations(do, q, k, v, **opts)
    for name, g, r, y in zip(("dq", "dk", "dv"), grads, refs, yards):
        assert_within_rule(name, np.asarray(g), r, y, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_jit_grad_score_modifiers_and_dsinks(rng, dtype):
    """softcap (static), ALiBi slopes and sinks (traced arrays) under jit(grad): o and dq, dk, dv
    and the sinks' gradient bit for bit cuflash's NumPy calls; under vmap one call per element."""
    q, k, v = random_inputs(rng, (2, 4, 6, 8), (2, 2, 9, 8), dtype)
    do = random_array(rng, q.shape, dtype)
    slopes = rng.uniform(0.01, 0.5, (2, 4)).astype(np.float32)
    sinks = rng.standard_normal(4).astype(np.float32)
    opts = dict(causal="bottom_right", softcap=3.0)

    def loss(a, b, c, s, sl):
        o = cfj.attention(a, b, c, alibi_slopes=sl, sinks=s, **opts)
        return jnp.sum(o.astype(jnp.float32) * jnp.asarray(do).astype(jnp.float32))

    args = tuple(jnp.asarray(a) for a in (q, k, v, sinks, slopes))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    want_o, want_lse = cuflash.attention(q, k, v, alibi_slopes=slopes, sinks=sinks, return_lse=True, **opts)
    want = cuflash.attention_backward(do, q, k, v, want_o, want_lse, alibi_slopes=slopes, sinks=sinks, **opts)
    for g, w in zip(grads, want):
        assert same(g, w)
    o = jax.jit(lambda a, b, c, s, sl: cfj.attention(a, b, c, alibi_slopes=sl, sinks=s, **opts))(*args)
    assert same(o, want_o)
    # vmap over a leading axis of q, k, v; the per-head arrays keep their shapes
    vq, vk, vv = (np.stack([a, a]) for a in (q, k, v))
    mapped = jax.vmap(lambda a, b, c: cfj.attention(a, b, c, alibi_slopes=args[4], sinks=args[3], **opts))(
        jnp.asarray(vq), jnp.asarray(vk), jnp.asarray(vv))
    assert same(mapped[1], want_o)
    with pytest.raises(TypeError, match="sinks"):
        cfj.attention(*args[:3], sinks=sinks.astype(np.float64))
    with pytest.raises(ValueError, match="alibi_slopes"):
        cfj.attention(*args[:3], alibi_slopes=slopes[:, :3])
    with pytest.raises(ValueError, match="softcap"):
        cfj.attention(*args[:3], softcap=0.0)


def test_jit_grad_packed_sequences(rng):
    q, k, v = random_inputs(rng, (9, 4, 8), (11, 2, 8), np.float16)
    do = random_array(rng, q.shape, np.float16)
    cu_q, cu_k = np.array([0, 4, 4, 9], np.int32), np.array([0, 5, 7, 11], np.int32)

    def loss(a, b, c, cq, ck):
        o = cfj.attention(a, b, c, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck, deterministic=True)
        return jnp.sum(o.astype(jnp.float32) * jnp.asarray(do, jnp.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, cu_q, cu_k)  # offsets traced
    want_o, vjp = cuflash.attention_vjp(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    for g, w in zip(grads, vjp(do, deterministic=True)):
        assert same(g, w)
    o, lse = jax.jit(lambda a, b, c: cfj.attention(a, b, c, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                   return_lse=True))(q, k, v)
    assert same(o, want_o) and lse.shape == (4, 9) and lse.dtype == jnp.float32
    # vmap over a stack of packed batches sharing the offsets: one call each
    mapped = jax.vmap(lambda a: cfj.attention(a, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))(jnp.stack([q, q[::-1]]))
    assert same(mapped[1], cuflash.attention(np.ascontiguousarray(q[::-1]), k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))


def test_jit_grad_packed_sequences_with_max_seqlens(rng):
    # max_seqlen_q / max_seqlen_k are static ints, carried to both callbacks with validate=False.
    q, k, v = random_inputs(rng, (9, 4, 8), (11, 2, 8), np.float16)
    do = random_array(rng, q.shape, np.float16)
    cu_q, cu_k = np.array([0, 4, 4, 9], np.int32), np.array([0, 5, 7, 11], np.int32)

    def loss(a, b, c, cq, ck):
        o = cfj.attention(a, b, c, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck, deterministic=True,
                          max_seqlen_q=5, max_seqlen_k=6, validate=False)
        return jnp.sum(o.astype(jnp.float32) * jnp.asarray(do, jnp.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, cu_q, cu_k)
    _, vjp = cuflash.attention_vjp(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    for g, w in zip(grads, vjp(do, deterministic=True)):
        assert same(g, w)
    with pytest.raises(ValueError, match=r"^max_seqlen_q: only with cu_seqlens_q / cu_seqlens_k"):
        cfj.attention(q[None], k[None], v[None], max_seqlen_q=4)


def test_kv_lens_and_paged_under_jit_and_vmap(rng):
    q, k, v = random_inputs(rng, (3, 2, 4, 1, 8), (3, 2, 2, 12, 8), np.float16)
    lens = rng.integers(0, 13, size=(3, 2)).astype(np.int32)
    mapped = jax.jit(jax.vmap(lambda a, b, c, n: cfj.attention(a, b, c, kv_lens=n, causal=True)))(q, k, v, lens)
    assert same(mapped, cuflash.attention(q, k, v, kv_lens=lens, causal=True))

    cache = [random_array(rng, (5, 16, 2, 8), np.float16) for _ in range(2)]
    table = np.array([[4, 1], [0, -1]], np.int32)
    plens = np.array([25, 9], np.int32)
    qd = random_array(rng, (2, 1, 4, 8), np.float16)
    got, lse = jax.jit(lambda a, t, n: cfj.attention(a, *cache, block_table=t, kv_lens=n, layout="bshd",
                                                      window=(6, -1), return_lse=True))(qd, table, plens)
    want, want_lse = cuflash.attention(qd, *cache, block_table=table, kv_lens=plens, layout="bshd", window=(6, -1),
                                       return_lse=True)
    assert same(got, want) and same(lse, want_lse)


def test_errors_name_the_argument(rng):
    q, k, v = (jnp.asarray(a) for a in random_inputs(rng, (1, 2, 3, 8), (1, 2, 4, 8), np.float32))
    lens = jnp.asarray([2], jnp.int32)
    with pytest.raises(ValueError, match=r"^kv_lens: KV-cache calls have no backward"):
        jax.grad(lambda a: jnp.sum(cfj.attention(a, k, v, kv_lens=lens)))(q)
    with pytest.raises(TypeError, match=r"^kv_lens: expected dtype int32"):
        cfj.attention(q, k, v, kv_lens=jnp.asarray([2], jnp.int16))
    with pytest.raises(TypeError, match=r"^window: expected"):
        cfj.attention(q, k, v, window=2)
    with pytest.raises(ValueError, match=r"^q: expected 3 dimensions with cu_seqlens_"):
        cfj.attention(q, k, v, cu_seqlens_q=jnp.asarray([0, 3], jnp.int32), cu_seqlens_k=jnp.asarray([0, 4], jnp.int32))
    with pytest.raises(TypeError, match=r"^return_lse"):
        cfj.attention(q, k, v, return_lse=1)
    # lse has no gradient: differentiating through it gives zeros, o's gradient is unchanged
    g = jax.grad(lambda a: jnp.sum(cfj.attention(a, k, v, return_lse=True)[1]))(q)
    assert not np.asarray(g).any()


@pytest.mark.gpu
def test_gpu_jit_grad_against_reference(rng):
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend")
    q, k, v = random_inputs(rng, (2, 8, 150, 64), (2, 2, 170, 64), BFLOAT16)
    do = random_array(rng, q.shape, BFLOAT16)
    opts = dict(causal=True, window=(40, -1))
    args = [jax.device_put(a, gpu) for a in (q, k, v)]
    grads = jax.jit(jax.grad(_loss(opts, jax.device_put(do, gpu)), argnums=(0, 1, 2)))(*args)
    jax.block_until_ready(grads)
    assert all(g.devices() == {gpu} for g in grads)
    assert_backward_accurate(tuple(np.asarray(g) for g in grads), do, q, k, v, **opts)
    # one query token against caches of 400 keys filled to different lengths: the split-KV decode kernel
    kc, vc = (random_array(rng, (2, 2, 400, 64), BFLOAT16) for _ in range(2))
    lens = np.array([400, 33], np.int32)
    qd = random_array(rng, (2, 8, 1, 64), BFLOAT16)
    o = jax.jit(lambda a, b, c, n: cfj.attention(a, b, c, kv_lens=n, validate=False))(
        *(jax.device_put(x, gpu) for x in (qd, kc, vc, lens)))
    assert_within_rule("decode o", np.asarray(o), *_decode_reference(qd, kc, vc, lens), BFLOAT16)


def _decode_reference(q, k, v, lens):
    """(float64 reference, yardstick realizations) of a kv_lens call, sequence by sequence."""
    from cuflash.testing import faithful_realizations, reference64

    refs, yards = [], []
    for b, n in enumerate(lens):
        sl = (slice(b, b + 1), slice(None), slice(0, int(n)))
        refs.append(reference64(q[b:b + 1], k[sl], v[sl])[0])
        yards.append(faithful_realizations(q[b:b + 1], k[sl], v[sl]))
    return np.concatenate(refs), [np.concatenate(y) for y in zip(*yards)]
