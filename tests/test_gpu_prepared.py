"""prepare_attention on the GPU: the decode fast path (packed launches) against cuflash.attention
(bit for bit) and the float64 reference (naive-error rule), with fresh data every call."""

import numpy as np
import pytest

import cuflash
from cuflash.kernels import pdl
from cuflash.api import plan_cache
from cuflash.core.arrays import BFLOAT16, FLOAT16
from cuflash.testing import random_inputs
from cuflash.kernels import decode as decode_kernels
from cuflash.plan import decode as plan_decode

from _kvlens_check import check_per_sequence
from test_paged import paged_cache

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def uncached_attention():
    """cuflash.attention uncached here: the prepared path is compared with attention's own."""
    with plan_cache.disabled():
        yield


def _bits(a):
    a = a.get() if hasattr(a, "get") else a
    return np.ascontiguousarray(a).view(np.uint8)


# (b, hq, hkv, nq, nk): which merge the planner picks on an H200 (132 SMs)
SHAPES = {
    "cluster-split": (2, 8, 2, 1, 1500),  # 4 splits merged in a cluster
    "combine-split": (1, 4, 4, 1, 70000),  # long splits: the combine kernel
    "no-split": (40, 32, 8, 1, 700),  # a (sequence, head) block per SM: the capped no-split tile
    "gqa-7-tokens": (3, 16, 4, 7, 2000),  # 28 packed rows (two row tiles)
}


def _case(rng, shape, dtype, case):
    b, hq, hkv, nq, nk = shape
    q, k, v = random_inputs(rng, (b, hq, nq, 128), (b, hkv, nk, 128), dtype)
    lens = rng.integers(2, nk + 1, size=b).astype(np.int32)
    if b >= 3:
        lens[:2] = [0, 1]
    kw, host = {}, dict(q=q, k=k, v=v, lens=lens if case != "plain" else np.full(b, nk, np.int32))
    if case == "paged":
        used = sum(-(-int(n) // 64) for n in lens)  # the same cache size every call (the geometry)
        kc, vc, table = paged_cache(rng, k, v, lens, 64, spare=b * -(-nk // 64) + 3 - used)
        args = (cupy.asarray(q), cupy.asarray(kc), cupy.asarray(vc))
        kw = dict(kv_lens=cupy.asarray(lens), block_table=cupy.asarray(table))
    else:
        args = tuple(cupy.asarray(a) for a in (q, k, v))
        if case in ("lens", "window"):
            kw = dict(kv_lens=cupy.asarray(lens))
    return args, kw, host


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("case", ["plain", "lens", "paged", "window"])
@pytest.mark.parametrize("validate", [True, False], ids=["validate", "no-validate"])
def test_prepared_decode_matches_attention(shape, case, validate):
    # Three calls with fresh arrays of the prepared geometry (new addresses, new kv_lens values):
    # each result equals cuflash.attention's bit for bit and the reference; outputs poisoned.
    b, hq, hkv, nq, nk = SHAPES[shape]
    rng = np.random.default_rng([b, nk, len(case), validate])
    causal = "bottom_right" if case != "plain" else False
    window = (333, 0) if case == "window" else None
    opts = dict(causal=causal, window=window, return_lse=True, validate=validate)
    args, kw, _ = _case(rng, SHAPES[shape], BFLOAT16, case)
    run = cuflash.prepare_attention(*args, **opts, **kw)
    assert run.path == "decode", run
    for trial in range(3):
        args, kw, host = _case(rng, SHAPES[shape], BFLOAT16, case)
        before = [_bits(a).copy() for a in (*args, *kw.values())]
        out = cupy.full(args[0].shape, np.nan, dtype=BFLOAT16)
        o, lse = run(*args, out=out, **kw)
        assert o is out
        want_o, want_lse = cuflash.attention(*args, **opts, **kw)
        np.testing.assert_array_equal(_bits(o), _bits(want_o))
        np.testing.assert_array_equal(_bits(lse), _bits(want_lse))
        for a, a0 in zip((*args, *kw.values()), before):
            np.testing.assert_array_equal(_bits(a), a0)  # inputs untouched
        if trial == 0:
            check_per_sequence(o, lse, host["q"], host["k"], host["v"], host["lens"], causal, BFLOAT16, window=window)


def test_prepared_decode_fresh_outputs_and_layouts():
    # No out=: fresh outputs; "bshd" q; float16; return_lse False gives o alone.
    rng = np.random.default_rng(7)
    b, hq, hkv, nq, nk = 4, 32, 8, 2, 3000
    q, k, v = random_inputs(rng, (b, nq, hq, 128), (b, nk, hkv, 128), FLOAT16)
    qg, kg, vg = (cupy.asarray(a) for a in (q, k, v))
    run = cuflash.prepare_attention(qg, kg, vg, layout="bshd", causal=True)
    assert run.path == "decode"
    o = run(qg, kg, vg)
    want_o, want_lse = cuflash.attention(qg, kg, vg, layout="bshd", causal=True, return_lse=True)
    np.testing.assert_array_equal(_bits(o), _bits(want_o))
    check_per_sequence(o.get().transpose(0, 2, 1, 3), want_lse, q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
                       v.transpose(0, 2, 1, 3), [nk] * b, True, FLOAT16)


def test_prepared_decode_combine_as_dependent(monkeypatch):
    # The combine kernel launched through cuLaunchKernelEx (ctypes) as a programmatic dependent,
    # as attention does for caches of 512 MiB and more (the gate lowered to every cache).
    if not pdl.available():
        pytest.skip("programmatic dependent launch needs sm_90 and cuda-bindings")
    monkeypatch.setattr(decode_kernels, "PDL_COMBINE_MIN_BYTES", 0)
    monkeypatch.setattr(plan_decode, "MERGE", "kernel")  # (by default the last split merges: no combine)
    rng = np.random.default_rng(11)
    b, hq, hkv, nq, nk = SHAPES["combine-split"]
    args, kw, host = _case(rng, SHAPES["combine-split"], BFLOAT16, "lens")
    run = cuflash.prepare_attention(*args, return_lse=True, **kw)
    assert run._decode.combine._config is not None  # the programmatic launch
    out = cupy.full(args[0].shape, np.nan, dtype=BFLOAT16)
    o, lse = run(*args, out=out, **kw)
    want_o, want_lse = cuflash.attention(*args, return_lse=True, **kw)
    np.testing.assert_array_equal(_bits(o), _bits(want_o))
    np.testing.assert_array_equal(_bits(lse), _bits(want_lse))
    check_per_sequence(o, lse, host["q"], host["k"], host["v"], host["lens"], False, BFLOAT16)


def test_prepared_decode_unaligned_call_falls_back():
    # Same geometry, but K starts 2 bytes into its buffer: the decode kernel's 16-byte loads cannot
    # read it, so the call runs cuflash.attention (the prefill kernel), still exact.
    rng = np.random.default_rng(3)
    b, hq, hkv, nq, nk = 2, 8, 2, 1, 1500
    q, k, v = random_inputs(rng, (b, hq, nq, 128), (b, hkv, nk, 128), FLOAT16)
    qg, kg, vg = (cupy.asarray(a) for a in (q, k, v))
    run = cuflash.prepare_attention(qg, kg, vg)
    buf = cupy.empty(kg.size + 1, dtype=FLOAT16)
    ku = buf[1:].reshape(kg.shape)
    ku[...] = kg
    assert ku.strides == kg.strides and ku.data.ptr % 16
    o = run(qg, ku, vg)
    np.testing.assert_array_equal(_bits(o), _bits(cuflash.attention(qg, ku, vg)))
    check_per_sequence(o, cuflash.attention(qg, ku, vg, return_lse=True)[1], q, k, v, [nk] * b, False, FLOAT16)


def test_prepared_decode_bad_values_and_geometry():
    rng = np.random.default_rng(5)
    args, kw, _ = _case(rng, SHAPES["cluster-split"], BFLOAT16, "paged")
    run = cuflash.prepare_attention(*args, **kw)
    bad = kw["kv_lens"].copy()
    bad[0] = 10**6
    with pytest.raises(ValueError, match="kv_lens"):
        run(*args, kv_lens=bad, block_table=kw["block_table"])
    table = kw["block_table"].copy()
    table[1, 0] = args[1].shape[0]
    with pytest.raises(ValueError, match="block_table"):
        run(*args, kv_lens=kw["kv_lens"], block_table=table)
    with pytest.raises(ValueError, match="^q: prepared for"):
        run(args[0][:1], *args[1:], **kw)
    with pytest.raises(ValueError, match="^kv_lens: prepared for"):
        run(*args, block_table=kw["block_table"])
    with pytest.raises(ValueError, match="out: must not overlap input q"):
        run(*args, out=args[0], **kw)
    with pytest.raises(TypeError, match="out: expected dtype bfloat16"):
        run(*args, out=cupy.empty(args[0].shape, dtype=np.float16), **kw)
    with pytest.raises(ValueError, match="out: expected a C-contiguous"):
        run(*args, out=cupy.empty(args[0].shape[::-1], dtype=BFLOAT16).transpose(3, 2, 1, 0), **kw)


def on_side_stream(torch, calls):
    """calls() on a torch side stream that first waits for the current one, synchronized after."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        result = calls()
    side.synchronize()
    return result


@pytest.mark.parametrize("case", ["lens", "paged"])
def test_prepared_decode_torch(case):
    # torch tensors: torch's allocator and current stream (a side stream here); results are
    # tensors equal bit for bit to cuflash.attention's on the same tensors.
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng([len(case), 23])
    args, kw, host = _case(rng, SHAPES["cluster-split"], BFLOAT16, case)
    targs = [torch.from_dlpack(a) for a in args]
    tkw = {n: torch.from_dlpack(a) for n, a in kw.items()}
    run = cuflash.prepare_attention(*targs, causal=True, return_lse=True, **tkw)
    assert run.path == "decode"
    (o, lse), (want_o, want_lse) = on_side_stream(
        torch, lambda: (run(*targs, **tkw), cuflash.attention(*targs, causal=True, return_lse=True, **tkw)))
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and o.shape == targs[0].shape
    assert torch.equal(o.view(torch.int16), want_o.view(torch.int16))
    assert torch.equal(lse, want_lse)
    check_per_sequence(cupy.from_dlpack(o.view(torch.int16)).view(BFLOAT16), cupy.from_dlpack(lse),
                       host["q"], host["k"], host["v"], host["lens"], True, BFLOAT16)
    with pytest.raises(ValueError, match="^q: prepared for"):
        run(targs[0].float(), *targs[1:], **tkw)
    with pytest.raises(ValueError, match="^q: prepared for torch"):
        run(args[0], *targs[1:], **tkw)  # a CuPy array where a tensor was prepared


def test_prepared_torch_reads_lens_after_their_writes():
    # validate=True reads kv_lens on the host each call. With torch tensors that read must follow
    # the writes queued on torch's current stream: here an out-of-range length written behind a
    # ~25 ms GPU spin on a side stream, so a read that does not wait sees the old, valid lengths.
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(31)
    shape = SHAPES["cluster-split"]
    args, kw, _ = _case(rng, shape, BFLOAT16, "lens")
    targs = [torch.from_dlpack(a) for a in args]
    lens = torch.from_dlpack(kw["kv_lens"])
    run = cuflash.prepare_attention(*targs, kv_lens=lens)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        lens.fill_(shape[-1] + 1)
        with pytest.raises(ValueError, match=r"^kv_lens: values must lie in"):
            run(*targs, kv_lens=lens)
    side.synchronize()


def test_prepared_prefill_runs_attention():
    # A prefill shape takes cuflash.attention per call (path "attention"), same results.
    rng = np.random.default_rng(29)
    q, k, v = random_inputs(rng, (2, 4, 300, 64), (2, 4, 300, 64), FLOAT16)
    qg, kg, vg = (cupy.asarray(a) for a in (q, k, v))
    run = cuflash.prepare_attention(qg, kg, vg, causal=True)
    assert run.path == "attention"
    np.testing.assert_array_equal(_bits(run(qg, kg, vg)), _bits(cuflash.attention(qg, kg, vg, causal=True)))
