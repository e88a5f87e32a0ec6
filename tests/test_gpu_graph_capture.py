"""cuflash calls captured into a CUDA graph and replayed (CuPy's stream capture).

A decode loop spends ~90 us of host time per call; a graph replays the same launches without it.
The graph owns the per-call buffers when CuPy allocates through MemoryAsyncPool. Each replay
runs on fresh values written in place into the captured inputs, and must equal (bitwise) a
direct call on the same values - and the direct call must meet the accuracy rule."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import cuflash
from cuflash.core.arrays import FLOAT16
from cuflash.testing import assert_forward_accurate, random_array, to_numpy
from cuflash.kernels import decode as decode_kernels
from cuflash.plan import decode as plan_decode

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.fixture
def async_pool():
    """CuPy's stream-ordered allocator for the test (allocations in a capture become the graph's)."""
    pool = cupy.cuda.MemoryAsyncPool()
    old = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(pool.malloc)
    try:
        yield pool
    finally:
        cupy.cuda.Device().synchronize()
        cupy.cuda.set_allocator(old)


def _capture(stream, fn):
    with stream:
        stream.begin_capture()
        try:
            result = fn()
        finally:
            graph = stream.end_capture()
    return graph, result


def _fill(rng, a, scale=1.0):
    a[...] = cupy.asarray(random_array(rng, a.shape, a.dtype, scale))


def _replay(graph, stream):
    """Launch on the capture stream after the updates made on the default stream (a non-blocking
    stream does not wait for it), then wait for the replay."""
    cupy.cuda.Stream.null.synchronize()
    graph.launch(stream)
    stream.synchronize()


def _bits(a):
    return to_numpy(a).view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("via", ["attention", "prepared"])
@pytest.mark.parametrize("b,hq,hkv,nk,pdl_combine", [(2, 8, 2, 5000, False), (1, 4, 4, 70000, False),
                                                     (1, 4, 4, 70000, True), (3, 4, 1, 700, False)],
                         ids=["cluster-split", "last-split-merge", "combine-kernel-pdl", "one-block"])
def test_decode_replays(async_pool, monkeypatch, b, hq, hkv, nk, pdl_combine, via):
    # ("last-split-merge": the last split of each pair merges, with split counters of the graph's
    # own, zeroed by a memset node on every replay; pdl_combine: the combine kernel instead,
    # launched as the split kernel's programmatic dependent: the capture must keep that edge, and
    # the replay be exact; via "prepared": the step is a cuflash.prepare_attention call, its
    # packed launches captured)
    from cuflash.kernels import pdl

    if pdl_combine:
        if not pdl.available():
            pytest.skip("programmatic dependent launch needs sm_90 and cuda-bindings")
        monkeypatch.setattr(decode_kernels, "PDL_COMBINE_MIN_BYTES", 0)
        monkeypatch.setattr(plan_decode, "MERGE", "kernel")
    rng = np.random.default_rng([b, hq, nk, 61])
    q = cupy.empty((b, hq, 1, 128), FLOAT16)
    k, v = (cupy.empty((b, hkv, nk, 128), FLOAT16) for _ in range(2))
    lens = cupy.empty((b,), np.int32)
    out = cupy.full(q.shape, np.nan, FLOAT16)
    for a in (q, k, v):
        _fill(rng, a)
    lens[...] = cupy.asarray(rng.integers(0, nk + 1, b).astype(np.int32))
    if via == "prepared":
        run = cuflash.prepare_attention(q, k, v, kv_lens=lens, validate=False)
        assert run.path == "decode"
        step = lambda: run(q, k, v, kv_lens=lens, out=out)  # noqa: E731
    else:
        step = lambda: cuflash.attention(q, k, v, kv_lens=lens, validate=False, out=out)  # noqa: E731
    step()  # compile outside the capture
    stream = cupy.cuda.Stream(non_blocking=True)
    graph, o = _capture(stream, step)
    assert o is out
    for trial in range(3):
        for a in (q, k, v):
            _fill(rng, a)
        lens[...] = cupy.asarray(rng.integers(0, nk + 1, b).astype(np.int32))
        out[...] = cupy.nan  # poison: the replay must write every element
        _replay(graph, stream)
        direct = cuflash.attention(q, k, v, kv_lens=lens)
        assert np.array_equal(_bits(out), _bits(direct)), f"replay {trial} differs from a direct call"
    # the direct call itself, against the reference over each sequence's first kv_lens keys
    lens_h = to_numpy(lens)
    for s in range(b):
        n = int(lens_h[s])
        if n:
            assert_forward_accurate(to_numpy(out)[s:s + 1], None, to_numpy(q)[s:s + 1],
                                              to_numpy(k)[s:s + 1, :, :n], to_numpy(v)[s:s + 1, :, :n])
        else:
            assert np.all(to_numpy(out)[s].astype(np.float32) == 0)


def test_paged_decode_replays(async_pool):
    rng = np.random.default_rng(62)
    b, hq, hkv, bs, pages = 3, 8, 2, 64, 40
    q = cupy.empty((b, hq, 1, 128), FLOAT16)
    blocks = b * pages + 7  # shuffled pages of a larger cache
    kc, vc = (cupy.empty((blocks, bs, hkv, 128), FLOAT16) for _ in range(2))
    table = cupy.asarray(rng.permutation(blocks)[: b * pages].reshape(b, pages).astype(np.int32))
    lens = cupy.asarray(rng.integers(1, pages * bs + 1, b).astype(np.int32))
    for a in (q, kc, vc):
        _fill(rng, a)
    out = cupy.empty(q.shape, FLOAT16)
    call = lambda: cuflash.attention(q, kc, vc, block_table=table, kv_lens=lens, validate=False, out=out)  # noqa: E731
    call()
    stream = cupy.cuda.Stream(non_blocking=True)
    graph, _ = _capture(stream, call)
    for _ in range(2):
        for a in (q, kc, vc):
            _fill(rng, a)
        table[...] = cupy.asarray(rng.permutation(blocks)[: b * pages].reshape(b, pages).astype(np.int32))
        out[...] = cupy.nan
        _replay(graph, stream)
        assert np.array_equal(_bits(out), _bits(cuflash.attention(q, kc, vc, block_table=table, kv_lens=lens)))


def test_prefill_forward_and_backward_replay(async_pool):
    # The Hopper TMA kernels take tensor maps built on the host: captured by value, still valid
    # for in-place updates of the same arrays. deterministic=True: a bitwise-reproducible dQ.
    rng = np.random.default_rng(63)
    q, k, v, do = (cupy.empty((2, 4, 333, 128), FLOAT16) for _ in range(4))
    for a in (q, k, v, do):
        _fill(rng, a)
    grads = tuple(cupy.empty_like(q) for _ in range(3))
    o = cupy.empty_like(q)

    def step():
        _, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, out=o)
        return cuflash.attention_backward(do, q, k, v, o, lse, causal=True, deterministic=True, out=grads)

    step()
    stream = cupy.cuda.Stream(non_blocking=True)
    graph, _ = _capture(stream, step)
    for _ in range(2):
        for a in (q, k, v, do):
            _fill(rng, a)
        _replay(graph, stream)
        o_direct, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
        direct = cuflash.attention_backward(do, q, k, v, o_direct, lse, causal=True, deterministic=True)
        assert np.array_equal(_bits(o), _bits(o_direct))
        for g, d in zip(grads, direct):
            assert np.array_equal(_bits(g), _bits(d))


def test_packed_sequences_replay_with_new_offsets(async_pool):
    # Packed sequences with max_seqlen_q / max_seqlen_k and validate=False read no offset on the
    # host, so a serving step with new sequence lengths replays one graph: the offsets are written
    # in place (other lengths, same totals, each within the maxima) and the replay equals a direct
    # call on them, forward and backward.
    rng = np.random.default_rng(66)
    total_q, total_k, hq, hkv, d = 300, 420, 4, 2, 128
    q, do = (cupy.empty((total_q, hq, d), FLOAT16) for _ in range(2))
    k, v = (cupy.empty((total_k, hkv, d), FLOAT16) for _ in range(2))
    cq, ck = cupy.asarray(np.array([0, 100, 100, 300], np.int32)), cupy.asarray(np.array([0, 150, 170, 420], np.int32))
    for a in (q, k, v, do):
        _fill(rng, a)
    o, grads = cupy.empty_like(q), (cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v))
    kw = dict(causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=200, max_seqlen_k=250, validate=False)

    def step():
        _, lse = cuflash.attention(q, k, v, return_lse=True, out=o, **kw)
        return cuflash.attention_backward(do, q, k, v, o, lse, deterministic=True, out=grads, **kw)

    step()
    stream = cupy.cuda.Stream(non_blocking=True)
    graph, _ = _capture(stream, step)
    for new_q, new_k in (([0, 200, 250, 300], [0, 250, 400, 420]), ([0, 0, 100, 300], [0, 5, 170, 420])):
        cq[...] = cupy.asarray(np.array(new_q, np.int32))
        ck[...] = cupy.asarray(np.array(new_k, np.int32))
        for a in (q, k, v, do):
            _fill(rng, a)
        _replay(graph, stream)
        checked = dict(causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck)
        o_direct, lse = cuflash.attention(q, k, v, return_lse=True, **checked)
        direct = cuflash.attention_backward(do, q, k, v, o_direct, lse, deterministic=True, **checked)
        assert np.array_equal(_bits(o), _bits(o_direct))
        for g, dg in zip(grads, direct):
            assert np.array_equal(_bits(g), _bits(dg))


def test_host_reads_under_capture_name_the_argument(async_pool):
    # validate=True reads kv_lens / block_table on the host: inside a capture that is a clear
    # ValueError (before any illegal copy, so the capture itself stays valid), not a CUDA error.
    rng = np.random.default_rng(64)
    q = cupy.asarray(random_array(rng, (2, 4, 1, 64), FLOAT16))
    k, v = (cupy.asarray(random_array(rng, (2, 4, 3000, 64), FLOAT16)) for _ in range(2))
    lens = cupy.asarray(np.array([5, 3000], np.int32))
    cuflash.attention(q, k, v, kv_lens=lens, validate=False)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(ValueError, match=r"^kv_lens: validate=True .*captured into a CUDA graph"):
                cuflash.attention(q, k, v, kv_lens=lens)
            cuflash.attention(q, k, v, kv_lens=lens, validate=False)  # the capture is still usable
        finally:
            graph = stream.end_capture()
    _replay(graph, stream)


def test_default_pool_capture_warns():
    rng = np.random.default_rng(65)
    q = cupy.asarray(random_array(rng, (1, 4, 1, 64), FLOAT16))
    k, v = (cupy.asarray(random_array(rng, (1, 4, 3000, 64), FLOAT16)) for _ in range(2))
    out = cupy.empty_like(q)
    cuflash.attention(q, k, v, out=out)
    stream = cupy.cuda.Stream(non_blocking=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph, _ = _capture(stream, lambda: cuflash.attention(q, k, v, out=out))
    assert any("MemoryAsyncPool" in str(w.message) for w in caught), [str(w.message) for w in caught]
    del graph
